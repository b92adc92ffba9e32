"""One RL step's summary record (a line of ``summary.json``), from what every rank reports.

Each rank sends a ``RankStepReport`` to rank 0 at the end of the step; ``step_record`` reduces them:
rewards and lengths over the samples each engine's leader reports (none counts twice), phase times as
the slowest rank's, the rollout's idle shares per rank, the engines' speculation figures, the acceptance
alarm (``spec/acceptance_alarms`` counts the engines whose rollout, or greedy probe after the sync, found
acceptance collapsed; ``spec/probe_acceptance_rate`` where probes ran), the drafter integrity checks
(``spec/drafter_integrity_*``, per step: see ``_integrity_fields``), the drafter's
(``drafter/tlt_drafter.summary_fields``) and, with a reward pool, its failures and overlap (``reward/*``).
``rollout/token_entropy`` is the mean -log p of the sampled tokens under the engine: the policy's entropy per
token, estimated from its own samples (at temperature 1 and top-p 1; a sharper sampler reads lower).
"""

from __future__ import annotations

import dataclasses
import statistics

from megatron_tlt.drafter.neighbour_slowdown import EngineStep, NeighbourSlowdown, neighbour_slowdown
from megatron_tlt.drafter.serving import QualityReport, quality_fields
from megatron_tlt.drafter.tlt_drafter import TailReport, summary_fields
from megatron_tlt.rl.rewards.pool import FAILURE_KINDS
from megatron_tlt.spec.drafter_integrity import IntegrityReport
from megatron_tlt.spec.metrics import SpecDecodeStats
from megatron_tlt.timeline.spans import BUSY, PHASES, TRAINING, RankTimeline, rollout_idle_seconds, rollout_idle_shares


@dataclasses.dataclass
class RewardPoolReport:
    """What a rank's reward pool did with its rollout (``rl/rewards/pool.py``)."""

    scored: int
    scored_in_rollout: int
    """Responses whose reward was ready when the reward phase began: scored while the rollout still ran."""
    failures: dict[str, int]
    """Responses given the failure value, by reason (``reward_pool.FAILURE_KINDS``)."""


@dataclasses.dataclass
class RankStepReport:
    """What one rank tells rank 0 about its step (travels as a plain object)."""

    timeline: RankTimeline
    rewards: list[float]
    correct: list[bool]
    lengths: list[int]
    truncated: list[bool]
    dropped_groups: int
    spec: SpecDecodeStats | None
    """The engine's speculation counters, from its leader only."""
    step_depths: list[int]
    bandit: dict | None
    tail: TailReport | None
    """What the drafter did in the rollout's tail (None: it did not train this step)."""
    hidden_tokens: int
    """Drafter feature rows the log-prob pass captured, counted once per replica."""
    probe: SpecDecodeStats | None = None
    """The acceptance probe after the step's sync and drafter push, from the engine's leader only."""
    alarm: bool = False
    """Whether the step's rollout or that probe raised the collapse alarm (leader only)."""
    reward_pool: RewardPoolReport | None = None
    """With data.reward_workers, from the ranks that scored on a pool."""
    integrity: IntegrityReport | None = None
    """The engine's drafter checks since the previous step's report (leader only; None where they are off)."""
    speedup_estimate: float | None = None
    """The engine's estimate of its rollout's time at depth 0 over the time it took (``spec/speedup_estimate.py``;
    leader only, None where it had none)."""
    engine_steps: list[EngineStep] = dataclasses.field(default_factory=list)
    """The rollout's engine steps (start, seconds, batch size, depth), from the engine's leader only."""
    quality: QualityReport | None = None
    """The drafters' held-out measure and the push decision (summed over ranks: the same figures on every rank;
    its seconds are this rank's)."""
    sampled_nll: float | None = None
    """Sum over the tokens of its samples of -log p(token) as the engine sampled them (None without log-probs)."""


def step_record(step: int, per_rank: list[RankStepReport], update: dict, sync_gb_s: float,
                step_seconds: float, ranks_per_node: int | None = None,
                slowdowns: list[NeighbourSlowdown] | None = None) -> dict:
    """``per_rank[r]`` is rank r's report; ``ranks_per_node`` (default: all on one node) says which ranks share a
    machine, for the spot trainer's cost to the generating ranks; ``slowdowns``: that cost per node where the
    caller has it already (``node_slowdowns``), else made here."""
    rewards = [r for p in per_rank for r in p.rewards]
    lengths = [n for p in per_rank for n in p.lengths]
    timelines = [p.timeline for p in per_rank]
    shares = rollout_idle_shares(timelines)
    phase = {name: max(t.seconds(name) for t in timelines) for name in PHASES}
    record = {
        "step": step,
        "reward_mean": statistics.fmean(rewards),
        "accuracy": statistics.fmean(float(c) for p in per_rank for c in p.correct),
        "response_length_mean": statistics.fmean(lengths),
        "response_length_median": statistics.median(lengths),
        "response_length_max": max(lengths),
        "truncated_share": statistics.fmean(float(c) for p in per_rank for c in p.truncated),
        "num_samples": len(rewards),
        "equal_reward_groups_dropped": sum(p.dropped_groups for p in per_rank),
        "rollout_seconds": phase["rollout"],
        "reward_seconds": phase["reward"],
        "logprob_seconds": phase["logprob"],
        "update_seconds": phase["update"],
        "sync_seconds": phase["sync"],
        "step_seconds": step_seconds,
        "rollout_busy_seconds": [t.seconds("rollout", BUSY) for t in timelines],
        "rollout_idle_seconds": [rollout_idle_seconds(t) for t in timelines],
        "rollout_training_seconds": [t.seconds("rollout", TRAINING) for t in timelines],
        "rollout_idle_share": shares,
        "rollout_idle_share_mean": statistics.fmean(shares),
        "sync_gb_per_s": sync_gb_s,
        "hidden_state_tokens_captured": sum(p.hidden_tokens for p in per_rank),
    }
    nll = [p.sampled_nll for p in per_rank if p.sampled_nll is not None]
    if nll:  # E[-log p(x)] over tokens x the policy sampled is its entropy (at temperature 1, top-p 1)
        record["rollout/token_entropy"] = sum(nll) / max(sum(lengths), 1)
    record.update({f"update/{k}": v for k, v in update.items()})
    record.update(_speculation_fields(per_rank))
    record.update(_alarm_fields(per_rank))
    record.update(_integrity_fields(per_rank))
    record.update(_reward_pool_fields(per_rank))
    record.update(summary_fields([p.tail for p in per_rank], timelines))
    record.update(_quality_fields(per_rank))
    if slowdowns is None:
        slowdowns = node_slowdowns(per_rank, ranks_per_node or len(per_rank))
    record.update(_neighbour_fields(slowdowns))
    return record


def node_slowdowns(per_rank: list[RankStepReport], ranks_per_node: int) -> list[NeighbourSlowdown]:
    """What the ranks that trained in the rollout cost the ranks still generating, per node
    (``drafter/neighbour_slowdown.py``); [] where no rank trained in the rollout."""
    trained = {r: [(s.start, s.end) for s in p.timeline.spans if s.phase == "rollout" and s.state == TRAINING]
               for r, p in enumerate(per_rank)}
    if not any(trained.values()):
        return []
    estimates = []
    for first in range(0, len(per_rank), ranks_per_node):
        node = range(first, min(first + ranks_per_node, len(per_rank)))
        estimates.append(neighbour_slowdown({r: per_rank[r].engine_steps for r in node}, {r: trained[r] for r in node}))
    return estimates


def worst_node(estimates: list[NeighbourSlowdown]) -> NeighbourSlowdown | None:
    """The node whose generating ranks the training cost most (None: no node has an estimate)."""
    measured = [e for e in estimates if e.rollout_cost is not None]
    return max(measured, key=lambda e: e.rollout_cost) if measured else None


def _neighbour_fields(estimates: list[NeighbourSlowdown]) -> dict:
    """The worst node's figures; none where no rank trained in the rollout."""
    if not estimates:
        return {}
    worst = worst_node(estimates)
    return {
        "drafter/neighbour_slowdown": worst.slowdown if worst else None,
        "drafter/spot_rollout_cost": worst.rollout_cost if worst else None,
        "drafter/neighbour_overlapped_share": max(e.overlapped_share for e in estimates),
    }


def _quality_fields(per_rank: list[RankStepReport]) -> dict:
    """The drafters' held-out measure (the same on every rank), its cost as the slowest rank's."""
    reports = [p.quality for p in per_rank if p.quality is not None]
    if not reports:
        return {}
    return quality_fields(dataclasses.replace(reports[0], seconds=max(r.seconds for r in reports)))


def _speculation_fields(per_rank: list[RankStepReport]) -> dict:
    total = sum((p.spec for p in per_rank if p.spec is not None), SpecDecodeStats())  # every engine's drafts
    if total.num_drafts == 0:
        return {}
    record = {"spec/mean_acceptance_length": total.mean_acceptance_length, "spec/acceptance_rate": total.acceptance_rate}
    if total.accepted_per_position:  # vLLM's per-position rate: drafts accepted through position i / drafts
        record["spec/acceptance_per_position"] = [n / total.num_drafts for n in total.accepted_per_position]
    depths = [d for p in per_rank for d in p.step_depths]
    if depths:  # BEG-MAB: how often each depth ran, and each engine's best depth per batch-size bucket
        engines = [p for p in per_rank if p.bandit is not None]  # their leaders' reports
        record["spec/engine_steps_by_depth"] = {str(k): depths.count(k) for k in sorted(set(depths))}
        record["spec/engine_steps"] = [len(p.step_depths) for p in engines]
        record["spec/best_depth_by_bucket"] = [{bucket: s["best"] for bucket, s in p.bandit.items()}
                                               for p in engines]
    estimate = _rollout_speedup_estimate(per_rank)
    if estimate is not None:
        record["spec/rollout_speedup_vs_depth0"] = estimate
    return record


def _rollout_speedup_estimate(per_rank: list[RankStepReport]) -> float | None:
    """The rollout phase's estimated speedup over depth 0: the phase lasts as long as its slowest engine, so at
    depth 0 it would have lasted the longest of each engine's busy time x its own estimate. None unless
    every engine that speculated has an estimate."""
    engines = [p for p in per_rank if p.spec is not None]  # their leaders
    if not engines or any(p.speedup_estimate is None for p in engines if p.spec.num_drafts):
        return None
    busy = [p.timeline.seconds("rollout", BUSY) for p in engines]
    if max(busy) <= 0:
        return None
    return max(b * (p.speedup_estimate or 1.0) for b, p in zip(busy, engines)) / max(busy)


def _alarm_fields(per_rank: list[RankStepReport]) -> dict:
    """The alarm count wherever an engine speculated or probed; the probe's acceptance where probes ran."""
    record = {}
    if any(p.alarm or p.probe is not None or (p.spec is not None and p.spec.num_drafts) for p in per_rank):
        record["spec/acceptance_alarms"] = sum(p.alarm for p in per_rank)
    probes = [p.probe for p in per_rank if p.probe is not None]
    if probes:
        record["spec/probe_acceptance_rate"] = sum(probes, SpecDecodeStats()).acceptance_rate
    return record


def _integrity_fields(per_rank: list[RankStepReport]) -> dict:
    """Per step, over the engines whose drafter is checked (``spec/drafter_integrity.py``); the first step's
    include the checks at engine start:
    ``spec/drafter_integrity_failures``: pushes still wrong after the re-push (each left its engine without
    speculation); ``spec/drafter_integrity_mismatches``: checks that found the engine's drafter wrong, those the
    re-push or the next push fixed included; ``spec/drafter_integrity_seconds``: the slowest engine's time in the
    checks; ``spec/speculation_suspended``: engines that end the step without speculation."""
    reports = [p.integrity for p in per_rank if p.integrity is not None]
    if not reports:
        return {}
    return {
        "spec/drafter_integrity_failures": sum(r.failures for r in reports),
        "spec/drafter_integrity_mismatches": sum(r.mismatches for r in reports),
        "spec/drafter_integrity_seconds": max(r.seconds for r in reports),
        "spec/speculation_suspended": sum(r.speculation_suspended for r in reports),
    }


def _reward_pool_fields(per_rank: list[RankStepReport]) -> dict:
    """With a reward pool: responses given the failure value per reason (``reward/timeouts``,
    ``reward/worker_crashes``, ``reward/errors``) and the share scored while the rollout still ran."""
    pools = [p.reward_pool for p in per_rank if p.reward_pool is not None]
    if not pools:
        return {}
    record = {field: sum(p.failures.get(kind, 0) for p in pools) for kind, field in FAILURE_KINDS.items()}
    scored = sum(p.scored for p in pools)
    record["reward/scored_in_rollout_share"] = sum(p.scored_in_rollout for p in pools) / scored if scored else 0.0
    return record
