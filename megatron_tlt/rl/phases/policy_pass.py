"""Phase 3, the policy pass: old and reference log-probs, the optimizer steps, and the engine checked against them.

It runs through Megatron's schedules on the model-parallel group; gradients are all-reduced over DP and the token
mean covers the global batch (``rl/update.py``). With one optimizer step per rollout (``trainer.updates_per_step:
1``, the default) there is no log-prob pass: the update's own forward gives the old log-probs (detached) and the
drafter's features, as VeRL does on-policy; with several mini-batches the policy moves between them, so the old
log-probs are taken before the first. The update's loss compares the engine's log-probs of the sampled tokens with
the trainer's (``rl/rollout_agreement.py``); where the equal-reward filter leaves it nothing to train on, a few
sequences get a forward of their own so the engine is checked every step. Colocated, the engine's KV cache and
weights leave the device for the whole phase (``sync`` brings them back).
"""

from __future__ import annotations

import dataclasses
import statistics

import torch

from megatron_tlt.config import TLTConfig
from megatron_tlt.device import module_device
from megatron_tlt.drafter.step_hooks import DrafterStepPlan
from megatron_tlt.drafter.tlt_drafter import TailReport
from megatron_tlt.rl import rollout_agreement
from megatron_tlt.rl.actor import compute_logprobs
from megatron_tlt.rl.phases.drafter_feed import DrafterFeed
from megatron_tlt.rl.phases.reward import ScoredStep
from megatron_tlt.rl.update import PolicySequence, agreement_by_forward, policy_update_step
from megatron_tlt.timeline.spans import RankTimeline


@dataclasses.dataclass
class PolicyPassOutcome:
    metrics: dict[str, float]
    """The optimizer steps' mean metrics (``update/*`` in the record)."""
    agreement: dict[str, float]
    """The engine against the trainer (``rollout_agreement.summary_fields``): the same on every rank."""
    feed: DrafterFeed
    """Where the features went: the held-out slice for the sync's gate, the rows captured."""
    serial_tail: TailReport | None
    """The serial schedule's drafter training after the update (None under TLT's)."""


class PolicyPass:
    def __init__(self, config: TLTConfig, *, model, reference, optimizer, lr_schedule, engine, drafter,
                 vocab_size: int, pad_id: int):
        t = config.trainer
        self.trainer_settings, self.algorithm, self.config = t, config.algorithm, config
        self.model, self.reference, self.optimizer, self.lr_schedule = model, reference, optimizer, lr_schedule
        self.engine, self.drafter = engine, drafter
        self.forward = dict(vocab_size=vocab_size, micro_batch_size=t.micro_batch_size, pad_id=pad_id,
                            micro_batch_tokens=t.micro_batch_tokens)
        self.on_policy = t.updates_per_step == 1

    def run(self, scored: ScoredStep, plan: DrafterStepPlan, timeline: RankTimeline) -> PolicyPassOutcome:
        self.engine.release_memory()
        feed = DrafterFeed(plan, scored, model=self.model, drafter=self.drafter, on_policy=self.on_policy,
                           quality_rows=self.config.drafter.quality_rows)
        feed.forward_the_held_out_rest(timeline, **self.forward)
        old, ref = self._logprob_pass(scored, feed, timeline)
        metrics, agreement = self._update(scored, old, ref, feed, timeline)
        serial_tail = self.drafter.after_update(plan, timeline)  # on the critical path, on this step's features
        return PolicyPassOutcome(metrics=metrics, agreement=rollout_agreement.summary_fields(agreement), feed=feed,
                                 serial_tail=serial_tail)

    def _logprob_pass(self, scored: ScoredStep, feed: DrafterFeed, timeline: RankTimeline):
        """Old log-probs (None on-policy) and reference log-probs by sequence index (None without the KL term or
        where every group was filtered out)."""
        sequences, old, ref = scored.sequences, None, None
        with timeline.phase("logprob"):
            if not self.on_policy:  # features are cut to what the drafter buffer keeps: a step can be far larger
                result = compute_logprobs(self.model, sequences, **self.forward, capture_hidden=feed.in_logprob_pass,
                                          max_feature_rows=self.config.drafter.buffer_tokens)
                old = result.token_logprobs
                feed.take(sequences, result, list(range(len(sequences))))
            # Only the sequences the update trains on: a filtered-out group's KL term is never read. On a model
            # that solves few prompts most groups score alike, and this forward was most of the phase.
            trained = [i for i, advantage in enumerate(scored.advantages) if advantage == advantage]  # not NaN
            if self.reference is not None and trained:
                rows = compute_logprobs(self.reference, [sequences[i] for i in trained], **self.forward).token_logprobs
                ref = dict(zip(trained, rows)) if rows else None  # no rows off the last pipeline stage
        return old, ref

    def _sequences(self, scored: ScoredStep, old, ref) -> list[tuple[int, PolicySequence]]:
        """The samples the update trains on (their group not filtered out), with their index among the step's."""
        device = module_device(self.model)  # where the log-prob pass left ``old`` and ``ref``
        kept = []
        for i, (sample, ids, advantage) in enumerate(zip(scored.samples, scored.sequences, scored.advantages)):
            if advantage != advantage:  # NaN: its group was filtered out
                continue
            placeholder = torch.zeros(len(ids) - 1, device=device)  # only the last stage computes the loss
            kept.append((i, PolicySequence(
                token_ids=ids, prompt_len=len(sample.prompt_ids),
                old_logprobs=None if self.on_policy else old[i] if old else placeholder, advantage=advantage,
                ref_logprobs=(ref[i] if ref else placeholder) if self.reference is not None else None,
                rollout_logprobs=rollout_agreement.label_row(sample, device))))
        return kept

    def _update(self, scored: ScoredStep, old, ref, feed: DrafterFeed, timeline: RankTimeline):
        """The step's optimizer steps: their mean metrics and the agreement over their tokens."""
        t = self.trainer_settings
        sequences = self._sequences(scored, old, ref)
        metrics: dict[str, list[float]] = {}
        per_update: list[dict[str, float]] = []
        with timeline.phase("update"):
            for u in range(t.updates_per_step):  # mini-batches interleave short and long sequences
                indices = [i for i, _ in sequences if i % t.updates_per_step == u]
                mini = [seq for i, seq in sequences if i % t.updates_per_step == u]
                # Advanced before the step, so optimizer step k runs at the schedule's k-th value
                # (Megatron's scheduler starts at init_lr 0, which would waste the first step).
                self.lr_schedule.step(1)
                metrics.setdefault("lr", []).append(self.optimizer.param_groups[0]["lr"])
                result = policy_update_step(self.model, self.optimizer, mini, **self.forward, settings=self.algorithm,
                                            capture_features=feed.in_update,
                                            max_feature_rows=self.config.drafter.buffer_tokens,
                                            agreement_bound=self.config.rollout.agreement_bound)
                if feed.in_update:
                    feed.take([seq.token_ids for seq in mini], result.features, indices)
                for key, value in rollout_agreement.without_agreement(result.metrics).items():
                    metrics.setdefault(key, []).append(value)
                per_update.append(result.metrics)
        agreement = rollout_agreement.combine(per_update)
        if not agreement["agreement_tokens"]:  # every group filtered out: the engine is checked all the same
            agreement = self._agreement_by_forward(scored, timeline)
        return {key: statistics.fmean(values) for key, values in metrics.items()}, agreement

    def _agreement_by_forward(self, scored: ScoredStep, timeline: RankTimeline) -> dict[str, float]:
        device = module_device(self.model)
        checked = [PolicySequence(token_ids=scored.sequences[i], prompt_len=len(scored.samples[i].prompt_ids),
                                  old_logprobs=None, advantage=0.0,
                                  rollout_logprobs=rollout_agreement.label_row(scored.samples[i], device))
                   for i in rollout_agreement.spread(len(scored.samples), rollout_agreement.FALLBACK_SEQUENCES)]
        with timeline.phase("logprob"):
            return agreement_by_forward(self.model, checked, **self.forward, bound=self.config.rollout.agreement_bound)
