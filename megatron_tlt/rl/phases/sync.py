"""Phase 4, sync: the drafter's gate, then the policy's new weights (and the drafter) into the engine.

The engine's memory comes back first (the policy pass released it). In a step that measures, the drafter trained
since the last decision is measured on the held-out slice against the one served and the run's start
(``candidate_and_push``); the sync then streams the policy into the engine, hands the drafter the policy's new
embedding and LM head, pushes the drafter the gate let through, checks it arrived, and probes the engine's
acceptance (``rl/rank_session.py``).
"""

from __future__ import annotations

import dataclasses

from megatron_tlt.drafter.serving import QualityReport
from megatron_tlt.drafter.step_hooks import DrafterStepPlan
from megatron_tlt.rl.phases.drafter_feed import DrafterFeed
from megatron_tlt.rl.weight_sync import SyncStats
from megatron_tlt.timeline.spans import RankTimeline


@dataclasses.dataclass
class SyncOutcome:
    stats: SyncStats
    quality: QualityReport | None
    """The drafters' held-out measure and the gate's decision (None: the step did not measure)."""


class SyncPhase:
    def __init__(self, *, session, engine, drafter):
        self.session, self.engine, self.drafter = session, engine, drafter

    def run(self, plan: DrafterStepPlan, feed: DrafterFeed, timeline: RankTimeline) -> SyncOutcome:
        self.engine.resume_memory()
        with timeline.phase("sync"):
            quality = self.drafter.candidate_and_push(plan, feed.held_out.measured)
            if quality is not None:  # the slice's own forward counts as the measure's cost
                quality = dataclasses.replace(quality, seconds=quality.seconds + feed.held_out.forward_seconds)
            stats = self.session.sync(self.engine, self.drafter, probe=True)
        return SyncOutcome(stats=stats, quality=quality)

    def first(self) -> SyncStats:
        """Before the first step: the engines start from dummy weights."""
        return self.session.sync(self.engine, self.drafter, probe=True)
