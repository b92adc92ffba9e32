"""Which forward of the step feeds the drafter, decided in one place.

On-policy (one optimizer step per rollout) the update's own forward captures the policy's features, of the
sequences it trains on; otherwise the log-prob pass does, over all of them. Either happens only in a step where
the drafter trains or is measured (``DrafterStepPlan.wants_features``). The held-out slice
(``rl/held_out_slice.py``) takes its sequences' features from that capture where it covers them and gets one
forward of its own for the rest, before the update changes the policy; the drafter trains on the others.
"""

from __future__ import annotations

from megatron_tlt.drafter.step_hooks import DrafterStepPlan
from megatron_tlt.rl import held_out_slice
from megatron_tlt.rl.actor import CapturedFeatures, features_on_every_stage
from megatron_tlt.rl.held_out_slice import HeldOutSlice
from megatron_tlt.rl.phases.reward import ScoredStep
from megatron_tlt.timeline.spans import RankTimeline


class DrafterFeed:
    """One step's routing of the policy's features to the drafter and the held-out slice."""

    def __init__(self, plan: DrafterStepPlan, scored: ScoredStep, *, model, drafter, on_policy: bool,
                 quality_rows: int):
        self.plan, self.model, self.drafter = plan, model, drafter
        self.in_logprob_pass = plan.wants_features and not on_policy
        """Whether the log-prob pass captures features (off-policy)."""
        self.in_update = plan.wants_features and on_policy
        """Whether the update's forward captures features (on-policy)."""
        chosen = held_out_slice.choose(scored.samples, quality_rows) if plan.measures else []
        # on-policy the update's forward sees only the groups the equal-reward filter keeps (advantage not NaN)
        covered = {i for i in chosen
                   if self.in_logprob_pass or (self.in_update and scored.advantages[i] == scored.advantages[i])}
        self.held_out = HeldOutSlice(scored.samples, scored.sequences, chosen, in_update=covered)
        self.rows = 0
        """Feature rows captured this step (0 off the last pipeline stage)."""

    def forward_the_held_out_rest(self, timeline: RankTimeline, **forward) -> None:
        """The slice's sequences no later pass captures, by a forward of their own (collective over the
        model-parallel group)."""
        with timeline.phase("logprob"):
            self.held_out.forward_the_rest(self.model, **forward)

    def take(self, sequences: list[list[int]], captured: CapturedFeatures, sample_indices: list[int]) -> None:
        """A pass's captured features (``sample_indices``: each sequence's index among the step's samples): the
        held-out slice's to the slice, the rest to the drafter when it trains this step."""
        self.held_out.take_from(captured, sample_indices)
        if self.plan.trains:  # every pipeline stage's idle ranks train: the last stage shares its features
            kept, features = features_on_every_stage(self.model, sequences, captured)
            trained = [k for k, i in enumerate(captured.feature_indices) if sample_indices[i] not in self.held_out]
            self.drafter.take_features([kept[k] for k in trained], [features[k] for k in trained])
        self.rows += sum(captured.feature_rows) if captured.features is not None else 0
