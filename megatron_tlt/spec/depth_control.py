"""Who sets the speculation depth of each engine step, and the engine's two overrides of it: speculation
suspended (a drafter that failed its integrity check) and the acceptance probe's full depth.

With adaptive speculation (``SpeculativeSettings.adaptive``) vLLM runs ``spec/adaptive_scheduler.py``'s scheduler,
whose depth policy (BEG-MAB or the goodput model) chooses each step's depth; without it vLLM's own scheduler runs
every step at the engine's depth K, from its table of depth by batch size (``dynamic_sd_lookup``). The methods take
vLLM's ``LLM`` rather than keep it: the engine owns it, and its shutdown waits for the last reference to go.
"""

from __future__ import annotations

import contextlib

from megatron_tlt.spec.engine_io import EngineError
from megatron_tlt.spec.speedup_estimate import speedup_over_depth0


def _vllm_scheduler(llm):
    """vLLM's scheduler in this process (in-process engine core): the adaptive one or vLLM's own."""
    return llm.llm_engine.engine_core.engine_core.scheduler


class DepthControl:
    """The depth of each engine step of one engine: its depth policy's, or pinned by the engine."""

    def __init__(self, *, speculating: bool, adaptive: bool) -> None:
        self.speculating = speculating
        self.adaptive = adaptive
        self.suspended = False
        self._restore_after_suspension = None  # the scheduler's pinned depth or depth table before it

    def adaptive_scheduler(self, llm):
        """The engine's adaptive scheduler, or None where the depth is fixed."""
        return _vllm_scheduler(llm) if self.adaptive else None

    def summary(self, llm) -> dict:
        """Per bucket: the best depth so far, pulls and median reward per depth ({} without adaptive speculation)."""
        scheduler = self.adaptive_scheduler(llm)
        return scheduler.bandit.summary() if scheduler is not None else {}

    def state(self, llm) -> dict | None:
        """The depth policy's state, plain JSON types (None without adaptive speculation)."""
        scheduler = self.adaptive_scheduler(llm)
        return scheduler.bandit.state_dict() if scheduler is not None else None

    def load_state(self, llm, state: dict) -> None:
        """Restore what the depth policy had learned (``state`` from ``state``)."""
        scheduler = self.adaptive_scheduler(llm)
        if scheduler is None:
            raise EngineError("BEG-MAB is off in this engine: there is no bandit state to load")
        scheduler.bandit.load_state_dict(state)

    def rollout_steps(self, llm, steps: list[tuple[int, float, float]]):
        """(depth of each step, (request, drafts accepted) of each step, speedup estimate) of the ``generate`` call
        whose steps (sequences in flight, seconds, wall-clock start) were ``steps``: the scheduler's logs of the
        call, drained. Empty lists and None without adaptive speculation; no estimate from pinned depths."""
        scheduler = self.adaptive_scheduler(llm)
        if scheduler is None:
            return [], [], None
        step_log, step_drafts = scheduler.drain_step_log(), scheduler.drain_draft_log()
        estimate = None
        if not scheduler.pinned and len(step_log) == len(steps):  # one entry per step
            timed = [(batch, depth, step_s) for (batch, depth), (_, step_s, _) in zip(step_log, steps)]
            estimate = speedup_over_depth0(timed, scheduler.bandit.rate)
        return [depth for _, depth in step_log], step_drafts, estimate

    def suspend(self, llm) -> None:
        """Generate without drafting until ``resume`` (a drafter that failed its integrity check).

        Every engine step then runs at depth 0, the per-step depth vLLM 0.32's scheduler hands its model runner
        (``SchedulerOutput.num_spec_tokens_to_schedule``): no draft tokens are proposed or verified, and the
        output is the target's alone. With adaptive speculation the depth is pinned to 0 (pinned steps teach the
        policy nothing); vLLM's own scheduler gets a speculation table of zeros, as
        ``num_speculative_tokens_per_batch_size`` with depth 0 everywhere would build it. vLLM still runs the
        drafter's first pass on each step's new tokens at depth 0, to keep its KV cache current: about one drafter
        layer per step.
        """
        if not self.speculating or self.suspended:
            return
        scheduler = _vllm_scheduler(llm)
        if self.adaptive:
            self._restore_after_suspension = scheduler.pinned_depth
            scheduler.pin_depth(0)
        else:
            self._restore_after_suspension = scheduler.dynamic_sd_lookup
            scheduler.dynamic_sd_lookup = [0] * (scheduler.scheduler_config.max_num_seqs + 1)
        self.suspended = True

    def resume(self, llm) -> None:
        """Speculate again as before ``suspend``."""
        if not self.suspended:
            return
        scheduler = _vllm_scheduler(llm)
        if self.adaptive:
            scheduler.pin_depth(self._restore_after_suspension)
        else:
            scheduler.dynamic_sd_lookup = self._restore_after_suspension
        self.suspended = False

    @contextlib.contextmanager
    def pinned_at(self, llm, depth: int):
        """Every step inside at ``depth`` (with adaptive speculation; vLLM's own scheduler already runs the engine's
        depth), then the pin as it was: the acceptance probe's full depth, which teaches the policy nothing."""
        scheduler = self.adaptive_scheduler(llm)
        pinned = scheduler.pinned_depth if scheduler is not None else None
        if scheduler is not None:
            scheduler.pin_depth(depth)
        try:
            yield
        finally:
            if scheduler is not None:
                scheduler.pin_depth(pinned)
