"""A colocated vLLM engine started on this rank, and shut down again without the process group under it.

Engines run in-process with vLLM's ``external_launcher`` executor: vLLM reuses the process group ParallelLayout
created (every rank builds its engine at the same time, since vLLM creates its groups collectively). An engine
starts with dummy weights from the policy's ``config.json``; the first weight sync makes it the policy. With
speculation it gets an EAGLE drafter of the policy's shape (``spec/eagle.py``) and, with adaptive speculation, the
scheduler that sets each step's depth (``spec/adaptive_scheduler.py``), whose settings are the config's
``speculation`` section.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import time
from pathlib import Path

import torch

from megatron_tlt import cpu_compat
from megatron_tlt.config import RolloutEngineConfig
from megatron_tlt.formats.architecture import PolicyArchitecture
from megatron_tlt.spec import drafter_transfer, reload_warnings
from megatron_tlt.spec.cuda_graphs import speculation_schedule
from megatron_tlt.spec.eagle import eagle_drafter_config
from megatron_tlt.spec.engine_environment import (prefer_step_depth_runner, set_device_environment,
                                                  torchrun_variables, write_engine_config)
from megatron_tlt.spec.engine_io import EngineError, SpeculativeSettings

logger = logging.getLogger(__name__)


def start_llm(arch: PolicyArchitecture, config: RolloutEngineConfig, speculative: SpeculativeSettings | None, *,
              workdir: Path, rank: int, tensor_parallel_size: int, vllm_version: str):
    """vLLM's ``LLM`` for this rank's share of an engine of ``tensor_parallel_size`` ranks, with dummy weights
    (collective: every rank of the world starts its engine at once); ``config.max_model_len`` must be set.
    Returns (the LLM, whether drafter pushes take GPU vLLM's draft-weight flow, seconds vLLM took to start)."""
    model_dir = workdir / f"engine-rank{rank}"
    write_engine_config(arch, model_dir)
    speculative_config = None
    if speculative is not None:
        drafter_dir = workdir / f"drafter-rank{rank}"
        drafter_dir.mkdir(parents=True, exist_ok=True)
        (drafter_dir / "config.json").write_text(json.dumps(eagle_drafter_config(arch), indent=2))
        speculative_config = {"method": "eagle", "model": str(drafter_dir),
                              "num_speculative_tokens": speculative.num_speculative_tokens,
                              "draft_sample_method": speculative.draft_sampling}
    draft_weight_api = speculative is not None and drafter_transfer.uses_draft_weight_api()
    transfer = {}
    if draft_weight_api:
        drafter_transfer.register_in_process_transfer()
        transfer = dict(weight_transfer_config={"backend": drafter_transfer.IN_PROCESS_TRANSFER})
    adaptive = {}
    if speculative is not None and speculative.adaptive is not None:
        from megatron_tlt.spec import adaptive_scheduler

        speculative.adaptive.arms(speculative.num_speculative_tokens)  # refused here, not inside vLLM
        prefer_step_depth_runner(vllm_version)
        # Dynamic speculation on; the table also tells vLLM which batch sizes may run speculative
        # shapes (its CUDA-graph capture tiers); the scheduler sets each step's depth itself.
        speculative_config["num_speculative_tokens_per_batch_size"] = speculation_schedule(
            speculative.adaptive, speculative.num_speculative_tokens, config.max_num_seqs)
        adaptive = dict(scheduler_cls=adaptive_scheduler.QUALIFIED_NAME, async_scheduling=False,
                        additional_config=adaptive_scheduler.bandit_additional_config(
                            speculative.adaptive, speculative.seed))
    if not torch.cuda.is_available():
        cpu_compat.enable_vllm_fixes()
        if tensor_parallel_size > 1:  # its ranks meet in /dev/shm segments named after the group only
            cpu_compat.remove_stale_engine_shm()
            torch.distributed.barrier()  # every rank is built at once: none may take a new segment for stale
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: weights pass as tensors
    set_device_environment(config, rank)
    from vllm import LLM

    reload_warnings.explain_rotary_reload_warning()
    started = time.perf_counter()
    try:
        with torchrun_variables(rank):
            llm = LLM(
                model=str(model_dir),
                skip_tokenizer_init=True,
                load_format="dummy",
                dtype=config.dtype,
                max_model_len=config.max_model_len,
                enforce_eager=config.enforce_eager,
                seed=config.seed,
                max_num_seqs=config.max_num_seqs,
                gpu_memory_utilization=config.gpu_memory_utilization,
                distributed_executor_backend="external_launcher",
                tensor_parallel_size=tensor_parallel_size,
                disable_log_stats=False,
                # log_softmax of the model's logits before temperature, top-p and penalties: what the trainer
                # computes (it applies no temperature), pinned so that a new default cannot change the check
                logprobs_mode="raw_logprobs",
                speculative_config=speculative_config,
                # sleep/wake frees the KV cache while the rank trains; only vLLM's GPU allocator has it
                enable_sleep_mode=torch.cuda.is_available(),
                # A prompt split over two steps rewinds its seeded generator, which CPU generators
                # cannot do ("CPU Generator does not use offset"): schedule whole prompts on CPU.
                enable_chunked_prefill=torch.cuda.is_available(),
                **transfer,
                **adaptive,
            )
    except Exception as err:  # vLLM raises bare RuntimeError/ValueError/OOM from deep inside
        raise EngineError(f"vLLM engine failed to start on rank {rank}: {type(err).__name__}: {err}") from err
    start_seconds = time.perf_counter() - started
    logger.info("rank %d: vLLM engine ready in %.1fs", rank, start_seconds)
    if adaptive and not config.enforce_eager:  # the capture sizes vLLM chose from the speculation table
        compilation = llm.llm_engine.vllm_config.compilation_config
        logger.info("rank %d: CUDA graphs captured for %s tokens (speculative shapes up to batch %s)", rank,
                    compilation.cudagraph_capture_sizes, speculative_config["num_speculative_tokens_per_batch_size"])
    return llm, draft_weight_api, start_seconds


@contextlib.contextmanager
def shutdown_keeping_default_group():
    """Shut an engine down, keeping the default process group (ParallelLayout owns it): the caller drops its last
    reference to the ``LLM`` inside (the engine core shuts down when the LLM object is collected).

    vLLM's shutdown calls ``destroy_distributed_environment``, which would destroy torch.distributed's default
    group under Megatron; for the duration of the shutdown it only drops vLLM's own handles.
    """
    from vllm.distributed import parallel_state as vllm_parallel_state

    def release_vllm_world_only() -> None:
        vllm_parallel_state._WORLD = None
        vllm_parallel_state._NODE_COUNT = None

    original = vllm_parallel_state.destroy_distributed_environment
    vllm_parallel_state.destroy_distributed_environment = release_vllm_world_only
    try:
        yield
        gc.collect()  # the engine core shuts down when the LLM object is collected
        vllm_parallel_state.destroy_model_parallel()
        release_vllm_world_only()
    finally:
        vllm_parallel_state.destroy_distributed_environment = original
