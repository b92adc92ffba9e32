"""The step's held-out slice for the drafter's measure (``drafter/serving.py``): which sequences, and their features.

The slice is the first sample of every group (groups the equal-reward filter drops included: once reward is
high they are most of what the rollout decodes), in prompt order, whole sequences up to ``drafter.quality_rows``
feature rows per rank. It is never trained on: the trainer keeps its sequences out of the drafter's buffer.

Its features are the policy's before the update (the policy that generated the step's rollouts). Where a pass
of the step captures drafter features anyway (the update's forward on-policy, as the default runs, over the
sequences it trains on; the log-prob pass otherwise, over all), the slice's sequences it covers are taken from
that capture at no cost; the rest (filtered groups on-policy, or every sequence where nothing is captured) get
one forward of their own before the update. Only each replica's last pipeline stage, first
TP rank, keeps them, so every sequence is measured once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from megatron_tlt.model import mcore
from megatron_tlt.rl.actor import CapturedFeatures, compute_logprobs

HeldOutSequence = tuple[list[int], torch.Tensor, int]
"""(token ids, the policy's features of positions 0 .. len-2, prompt length)."""


def choose(samples: Sequence, quality_rows: int) -> list[int]:
    """The slice: indices into ``samples`` (in group order) of each group's first sample, up to ``quality_rows``
    feature rows (the last sequence may pass it); the same on every rank of a model-parallel group."""
    chosen, rows = [], 0
    for i, sample in enumerate(samples):
        if rows >= quality_rows:
            break
        if sample.sample_index == 0:
            chosen.append(i)
            rows += len(sample.prompt_ids) + len(sample.response_ids) - 1
    return chosen


class HeldOutSlice:
    """One step's slice and the features gathered for it (on the ranks that measure)."""

    def __init__(self, samples: Sequence, sequences: list[list[int]], chosen: list[int], *,
                 in_update: set[int] = frozenset()):
        """``in_update``: the chosen sequences whose features a later pass of the step (the update's forward, or the
        log-prob pass) will capture."""
        self.samples, self.sequences = samples, sequences
        self.chosen = set(chosen)
        self._own_forward = [i for i in chosen if i not in in_update]
        self.measured: list[HeldOutSequence] = []
        self._taken: set[int] = set()
        self.forward_seconds = 0.0
        stage = mcore.stage_info()
        self._keeps = stage.tp_rank == 0 and stage.pp_rank == stage.pp_size - 1

    def __contains__(self, sample_index: int) -> bool:
        return sample_index in self.chosen

    def forward_the_rest(self, model: torch.nn.Module, *, vocab_size: int, micro_batch_size: int, pad_id: int,
                         micro_batch_tokens: int | None) -> None:
        """One forward over the chosen sequences the update will not capture (collective over the
        model-parallel group; a no-op where there are none, on every rank alike)."""
        if not self._own_forward:
            return
        start = time.perf_counter()
        captured = compute_logprobs(model, [self.sequences[i] for i in self._own_forward], vocab_size=vocab_size,
                                    micro_batch_size=micro_batch_size, pad_id=pad_id,
                                    micro_batch_tokens=micro_batch_tokens, capture_hidden=True)
        self.take_from(captured, self._own_forward)
        self.forward_seconds += time.perf_counter() - start

    def take_from(self, captured: CapturedFeatures, sample_indices: list[int]) -> None:
        """Keep the chosen sequences' features from a pass over sequences whose sample indices are
        ``sample_indices`` (no communication)."""
        if not self._keeps or captured.features is None:
            return
        for k, features in zip(captured.feature_indices, captured.hidden_states):
            i = sample_indices[k]
            if i in self.chosen and i not in self._taken:
                self._taken.add(i)
                self.measured.append((self.sequences[i], features, len(self.samples[i].prompt_ids)))
