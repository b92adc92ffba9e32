"""Phase 5, report: every rank's report of the step gathered into its summary record on rank 0.

Each rank sends a ``RankStepReport`` (``rl/run/step_record.py``); an engine's figures come from its leader only,
so none counts twice. Rank 0 makes the record, logs the step's samples, and measures what the spot trainer cost
the ranks still generating; every rank's duty cycle for the next rollout follows from it.
"""

from __future__ import annotations

import dataclasses
import time

import torch.distributed as dist

from megatron_tlt.drafter.neighbour_slowdown import engine_steps
from megatron_tlt.parallel import ParallelLayout
from megatron_tlt.rl.phases.policy_pass import PolicyPassOutcome
from megatron_tlt.rl.phases.reward import ScoredStep
from megatron_tlt.rl.phases.rollout import RolloutOutcome
from megatron_tlt.rl.phases.sync import SyncOutcome
from megatron_tlt.rl.rewards.pool import StreamedScores
from megatron_tlt.rl.run import samples_log
from megatron_tlt.rl.run.step_record import (RankStepReport, RewardPoolReport, node_slowdowns, step_record,
                                             worst_node)
from megatron_tlt.timeline.spans import RankTimeline


@dataclasses.dataclass
class StepOutcome:
    record: dict | None
    """The step's summary record (rank 0; None elsewhere)."""
    spans: list[dict] | None
    """Every rank's timeline spans of the step (rank 0; None elsewhere)."""
    agreement: dict[str, float]
    """The engine against the trainer (the same on every rank): the run's agreement check reads it."""


class ReportPhase:
    def __init__(self, *, session, layout: ParallelLayout, engine, drafter, tokenizer, reporter, log_samples: int):
        self.session, self.layout, self.engine, self.drafter = session, layout, engine, drafter
        self.tokenizer, self.reporter, self.log_samples = tokenizer, reporter, log_samples
        self.placement = session.placement
        self.rank, self.world = layout.rank, layout.world_size

    def run(self, step: int, started_at: float, rollout: RolloutOutcome, scored: ScoredStep,
            policy: PolicyPassOutcome, synced: SyncOutcome, timeline: RankTimeline) -> StepOutcome:
        """``step`` is 1-based; collective (a gather to rank 0, and the duty cycle's broadcast)."""
        report = self._rank_report(rollout, scored, policy, synced, timeline)
        gathered = [None] * self.world if self.rank == 0 else None
        dist.gather_object(report, gathered, dst=0)
        record, spans, cost = None, None, None
        if self.rank == 0:
            slowdowns = node_slowdowns(gathered, self.session.ranks_per_node)
            record = step_record(step, gathered, policy.metrics, synced.stats.gb_per_s, time.time() - started_at,
                                 ranks_per_node=self.session.ranks_per_node, slowdowns=slowdowns)
            record.update(policy.agreement)
            spans = [span for r in gathered for span in r.timeline.to_records(step)]
            cost = worst_node(slowdowns)
            if self.log_samples:
                decode = lambda ids: self.tokenizer.decode(list(ids), skip_special_tokens=False)  # noqa: E731
                self.reporter.log_samples(step, samples_log.sample_records(step, scored.own, decode, self.log_samples))
        self.drafter.adapt_duty_cycle(cost)  # backs off where training in the tail slowed the generating ranks
        return StepOutcome(record=record, spans=spans, agreement=policy.agreement)

    def _rank_report(self, rollout: RolloutOutcome, scored: ScoredStep, policy: PolicyPassOutcome,
                     synced: SyncOutcome, timeline: RankTimeline) -> RankStepReport:
        own, result = scored.own, rollout.result
        leader = self.placement.is_leader
        rolled = result if result is not None and leader else None  # an engine's figures, from its leader only
        return RankStepReport(
            timeline=timeline, rewards=[s.reward for s in own], correct=[s.correct for s in own],
            lengths=[len(s.response_ids) for s in own], truncated=[s.finish_reason == "length" for s in own],
            sampled_nll=(-sum(sum(s.rollout_logprobs) for s in own)
                         if own and own[0].rollout_logprobs is not None else None),
            dropped_groups=scored.dropped_groups if self.layout.model_parallel_rank == 0 else 0,
            spec=rolled.spec if rolled else None, step_depths=rolled.step_depths if rolled else [],
            bandit=self.engine.bandit_summary() if leader else None,
            tail=rollout.tail if rollout.tail is not None else policy.serial_tail,
            probe=synced.stats.probe if leader else None, alarm=(rollout.alarm or synced.stats.alarm) and leader,
            integrity=self.session.drafter_integrity_report(self.engine) if leader else None,
            # counted once per replica: the last stage's TP ranks hold the same features
            hidden_tokens=policy.feed.rows if self.layout.stage.tp_rank == 0 else 0,
            reward_pool=_pool_report(own, rollout.streamed), quality=synced.quality,
            speedup_estimate=rolled.speedup_estimate if rolled else None,
            engine_steps=engine_steps(rolled.step_started_at, rolled.step_seconds, rolled.step_batch_sizes,
                                      rolled.step_depths) if rolled else [])


def _pool_report(own, streamed: StreamedScores | None) -> RewardPoolReport | None:
    if streamed is None:
        return None
    return RewardPoolReport(scored=len(own), scored_in_rollout=streamed.scored_before_wait,
                            failures=dict(streamed.failures))
