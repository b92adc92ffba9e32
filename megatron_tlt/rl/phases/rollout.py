"""Phase 1, rollout: this engine's share of the step's prompts, then the long tail.

The ranks of one engine sample with one seed, so they hold the same responses. The phase ends at a barrier over
all ranks, so each rank's idle time in the long tail is measured exactly: a rank whose share is done trains the
drafter meanwhile (``idle_tail``) or waits idle.
"""

from __future__ import annotations

import dataclasses
import time

import torch.distributed as dist

from megatron_tlt.config import RolloutConfig
from megatron_tlt.drafter.step_hooks import DrafterStepPlan
from megatron_tlt.drafter.tlt_drafter import TailReport
from megatron_tlt.rl.inputs.data import PromptExample
from megatron_tlt.rl.rewards.pool import StreamedScores
from megatron_tlt.rl.scoring import ResponseScorer, rollout_seed
from megatron_tlt.spec.engine import RolloutResult
from megatron_tlt.timeline.spans import BUSY, IDLE, RankTimeline


@dataclasses.dataclass
class RolloutOutcome:
    prompts: list[PromptExample]
    """This engine's share of its DP rank's prompts (none: the engine had nothing to answer)."""
    result: RolloutResult | None
    streamed: StreamedScores | None
    """The reward pool's scoring of the responses as they finished (None without a pool)."""
    tail: TailReport | None
    """What the drafter did in the long tail (None: it did not train there)."""
    alarm: bool
    """Whether this rollout's own drafts raised the acceptance alarm (after the last sync and drafter push)."""


class RolloutPhase:
    def __init__(self, *, session, engine, drafter, scorer: ResponseScorer, rollout: RolloutConfig, seed: int):
        self.session, self.engine, self.drafter, self.scorer = session, engine, drafter, scorer
        self.settings, self.seed = rollout, seed
        self.placement = session.placement

    def run(self, step: int, examples: list[PromptExample], plan: DrafterStepPlan,
            timeline: RankTimeline) -> RolloutOutcome:
        mine = self.placement.replica_share(examples)
        streamed = self.scorer.stream(mine, f"step {step + 1} prompt") if mine else None
        start = time.time()
        result = None
        if mine:
            sampling = self.session.sampling(n=self.settings.samples_per_prompt, temperature=self.settings.temperature,
                                             seed=rollout_seed(self.seed, step, self.placement.leader_rank),
                                             logprobs=True)
            result = self.engine.generate([e.prompt_ids for e in mine], sampling,
                                          on_finished=streamed.on_finished if streamed is not None else None)
        done = time.time()
        timeline.add("rollout", BUSY, start, done)
        tail = self.drafter.idle_tail(plan, timeline)
        if tail is None:  # the phase ends when the slowest rank is done; until then this rank idles
            dist.barrier()
            timeline.add("rollout", IDLE, done, time.time())
        # The acceptance alarm after the last sync and drafter push, read from this rollout's own drafts: free.
        alarm = result is not None and self.engine.check_acceptance(result.spec, "the rollout after the policy sync")
        return RolloutOutcome(prompts=mine, result=result, streamed=streamed, tail=tail, alarm=alarm)
