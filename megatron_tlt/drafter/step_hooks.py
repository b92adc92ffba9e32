"""How the RL step's phases call the drafter: a plan per step and a hook per phase.

  rollout      ``idle_tail``           trains on this rank's idle time until the slowest rank is done (TLT's
                                       schedule); None where it did not, and the rollout phase waits idle instead
  policy pass  ``take_features``       the policy's fresh features of the step's sequences (which forward gives
                                       them is decided in one place, ``rl/phases/drafter_feed.py``)
               ``after_update``        the serial schedule's training, on the critical path (None under TLT's)
  sync         ``candidate_and_push``  measures a candidate on the held-out slice and lets the sync push it only
                                       if it measures as well as the one served (``drafter/serving.py``)
  report       ``adapt_duty_cycle``    the spot trainer's duty cycle for the next rollout from this one's cost

``TLTDrafter`` (``drafter/tlt_drafter.py``) implements them; ``NullDrafter`` stands where TLT is off, so the
phases never ask whether there is a drafter.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_tlt.drafter.neighbour_slowdown import NeighbourSlowdown
from megatron_tlt.timeline.spans import RankTimeline


@dataclasses.dataclass(frozen=True)
class DrafterStepPlan:
    """What the drafter does in one step (the same on every rank)."""

    trains_in_tail: bool = False
    """TLT's schedule: it trains on the ranks idle in the rollout's long tail."""
    trains_serially: bool = False
    """The peers' schedule (``drafter.schedule: serial``): it trains after the update, on the critical path."""
    measures: bool = False
    """The step measures the drafters on a held-out slice of its rollouts and decides a push."""

    @property
    def trains(self) -> bool:
        return self.trains_in_tail or self.trains_serially

    @property
    def wants_features(self) -> bool:
        """Whether the step's forwards capture the policy's features: to train on, or to measure with."""
        return self.trains or self.measures


class NullDrafter:
    """TLT off: no speculation, no drafter training; every hook does nothing."""

    wants_policy_heads = False

    def engine_speculation(self) -> None:
        return None

    def plan_step(self, step: int) -> DrafterStepPlan:
        return DrafterStepPlan()

    def idle_tail(self, plan: DrafterStepPlan, timeline: RankTimeline) -> None:
        return None

    def take_features(self, token_ids: list[list[int]], features: list[torch.Tensor]) -> None:
        raise AssertionError("no step plans features for a null drafter")

    def after_update(self, plan: DrafterStepPlan, timeline: RankTimeline) -> None:
        return None

    def candidate_and_push(self, plan: DrafterStepPlan, held_out: list) -> None:
        return None

    def adapt_duty_cycle(self, cost: NeighbourSlowdown | None) -> None:
        pass

    def save(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass
