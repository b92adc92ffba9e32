"""The model ``tlt plan`` sizes: its architecture (from an HF config or a shipped one) and its parameters per GPU."""

from __future__ import annotations

import json
import math
from pathlib import Path

from megatron_tlt.formats.architecture import (
    ModelConfigError,
    PolicyArchitecture,
    architecture_from_dict,
    load_architecture,
)

MODELS_DIR = Path(__file__).resolve().parents[2] / "launch" / "models"


class PlanError(ValueError):
    """A layout that cannot run, or does not fit; the message says why in one sentence."""


def shipped_models() -> list[str]:
    """Names of the HF configs shipped under ``launch/models`` (e.g. ``llama-3.3-70b``)."""
    if not MODELS_DIR.is_dir():
        return []
    return sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").is_file())


def resolve_model(model: str | Path) -> tuple[PolicyArchitecture, str]:
    """The architecture and a display name from an HF model directory, a config.json (any JSON file holding
    an HF config), or the name of a directory under ``launch/models`` (e.g. ``llama-3.3-70b``)."""
    path = Path(model)
    if not path.exists() and (MODELS_DIR / str(model)).is_dir():
        path = MODELS_DIR / str(model)
    try:
        if path.is_file():
            try:
                raw = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as err:
                raise ModelConfigError(f"{path}: not a readable JSON config ({err})") from None
            if not isinstance(raw, dict):
                raise ModelConfigError(f"{path}: not an HF config (a JSON object)")
            arch = architecture_from_dict(raw, source=str(path))
            name = path.resolve().parent.name if path.name == "config.json" else path.stem
        else:
            arch = load_architecture(path)
            name = path.resolve().name
    except ModelConfigError as err:
        known = shipped_models()
        hint = f" (shipped configs: {', '.join(known)})" if known else ""
        raise PlanError(f"{err}{hint}") from None
    return arch, name


def resolve_hf_dir(hf_dir: str) -> tuple[PolicyArchitecture, str, str | None]:
    """The architecture of ``model.hf_dir``: its config.json where the directory is here; else the shipped
    config whose name begins the directory's name, case aside (``/ckpt/Llama-3.3-70B-Instruct`` ->
    ``launch/models/llama-3.3-70b``), since a cluster's checkpoint path rarely exists where one plans.
    Returns (architecture, name, a note saying which config stood in, or None)."""
    if Path(hf_dir).expanduser().exists():
        arch, name = resolve_model(Path(hf_dir).expanduser())
        return arch, name, None
    base = Path(hf_dir).name.lower()
    matches = [m for m in shipped_models() if base.startswith(m.lower())]
    if not matches:
        raise PlanError(f"model.hf_dir {hf_dir} is not here and no shipped config matches its name (shipped: "
                        f"{', '.join(shipped_models()) or 'none'}): pass --model with its config.json")
    shipped = max(matches, key=len)
    arch, name = resolve_model(shipped)
    return arch, name, f"model.hf_dir {hf_dir} is not here: sized from launch/models/{shipped}/config.json"


def _layer_parameters(arch: PolicyArchitecture, *, input_norm: bool = True) -> int:
    """Parameters of one decoder layer (unsharded)."""
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_kv_heads * d
    attention = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if arch.qkv_bias else 0)
    mlp = 3 * h * arch.intermediate_size
    return attention + mlp + h * (2 if input_norm else 1)


def count_parameters(arch: PolicyArchitecture) -> int:
    """Parameters of the HF model (unpadded vocabulary; a tied LM head counted once)."""
    embedding = arch.vocab_size * arch.hidden_size
    heads = embedding * (1 if arch.tie_word_embeddings else 2)
    return heads + arch.num_layers * _layer_parameters(arch) + arch.hidden_size


def stage_parameters(arch: PolicyArchitecture, tensor_parallel_size: int, pipeline_parallel_size: int) -> list[int]:
    """Parameters one GPU holds in each pipeline stage, from Megatron's own tensor names, shapes and TP
    splits (``megatron_tlt.formats.weights``): TP-split tensors divided by TP, norms replicated, the padded
    vocabulary's embedding on the first stage and the LM head on the last (with tied embeddings and
    PP > 1, Megatron keeps a copy of the embedding there as the output layer)."""
    from megatron_tlt.formats import weights

    tp, pp = tensor_parallel_size, pipeline_parallel_size
    padded_vocab = arch.padded_vocab_size(tp)
    per_stage = [0] * pp
    for name in weights.megatron_names(arch):
        shape = weights.megatron_full_shape(arch, name, padded_vocab)
        numel = math.prod(shape)
        if weights.tp_split(name) is not weights.TPSplit.REPLICATED:
            numel //= tp
        per_stage[weights.owning_stage(arch, name, pp)] += numel
    if arch.tie_word_embeddings and pp > 1:
        per_stage[-1] += padded_vocab * arch.hidden_size // tp
    return per_stage


def drafter_parameters(arch: PolicyArchitecture) -> int:
    """The EAGLE drafter: one decoder layer without its first input norm, plus ``fc`` [h, 2h]; it uses the
    policy's embedding and LM head (``megatron_tlt/drafter/model.py``)."""
    return _layer_parameters(arch, input_norm=False) + 2 * arch.hidden_size * arch.hidden_size
