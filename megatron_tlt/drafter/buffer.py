"""A bounded buffer of the most recent sequences' hidden states, the drafter's training data.

The log-prob pass hands over, per sequence, its token ids and the policy's post-final-norm hidden states.
The buffer keeps whole sequences, oldest first, within a token budget (a token = one stored feature row,
the unit of memory). Adding a sequence that does not fit evicts the oldest whole sequences first (FIFO) until
it does: the drafter trains on the most recent policy's features, and a sequence is never cut. A sequence
with more feature rows than the whole budget is not stored; it is counted in ``num_tokens_rejected``.

Features are copied on the way in (detached, contiguous, on ``device``): the buffer never keeps a caller's
larger tensor alive through a view, and later in-place changes by the caller cannot reach it.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from megatron_tlt.drafter.packing import sequence_tensors


class BufferedSequence(NamedTuple):
    """One stored sequence; unpacks as ``(token_ids, features_th)``, the pair ``pack_sequences`` takes."""

    token_ids_t: Tensor
    features_th: Tensor

    @property
    def num_tokens(self) -> int:
        return self.features_th.shape[0]


class HiddenStateBuffer:
    """FIFO of whole sequences within ``max_tokens`` feature rows (module docstring).

    Counters (since construction or the last ``clear``): ``num_tokens_added`` and ``num_sequences_added`` count
    what was stored, ``num_tokens_evicted``/``num_sequences_evicted`` what was pushed out to make room, and
    ``num_tokens_rejected``/``num_sequences_rejected`` sequences larger than the whole budget.
    """

    def __init__(self, max_tokens: int, *, device: str | torch.device = "cpu"):
        if max_tokens < 1:
            raise ValueError(f"buffer max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.device = torch.device(device)
        self._sequences: collections.deque[BufferedSequence] = collections.deque()
        self.clear()

    def clear(self) -> None:
        """Forget every sequence and reset the counters."""
        self._sequences.clear()
        self.num_tokens = 0
        self.num_tokens_added = self.num_sequences_added = 0
        self.num_tokens_evicted = self.num_sequences_evicted = 0
        self.num_tokens_rejected = self.num_sequences_rejected = 0

    def __len__(self) -> int:
        return len(self._sequences)

    def add(self, token_ids: Sequence[int] | Tensor, features_th: Tensor) -> int:
        """Store one sequence (evicting the oldest as needed); returns the number of tokens evicted."""
        ids_t, features_th = sequence_tensors(token_ids, features_th)
        size = features_th.shape[0]
        if size > self.max_tokens:
            self.num_tokens_rejected += size
            self.num_sequences_rejected += 1
            return 0
        evicted = 0
        while self.num_tokens + size > self.max_tokens:
            oldest = self._sequences.popleft()
            self.num_tokens -= oldest.num_tokens
            evicted += oldest.num_tokens
            self.num_sequences_evicted += 1
        self.num_tokens_evicted += evicted
        stored = BufferedSequence(
            ids_t.to(self.device, copy=True),
            features_th.detach().to(self.device, copy=True, memory_format=torch.contiguous_format),
        )
        self._sequences.append(stored)
        self.num_tokens += size
        self.num_tokens_added += size
        self.num_sequences_added += 1
        return evicted

    def extend(self, token_ids_list: Sequence[Sequence[int] | Tensor], features_list: Sequence[Tensor]) -> int:
        """``add`` for each sequence in order (e.g. a ``LogProbResult``'s); returns the tokens evicted."""
        if len(token_ids_list) != len(features_list):
            raise ValueError(f"{len(token_ids_list)} token sequences but {len(features_list)} feature tensors")
        return sum(self.add(ids, feats) for ids, feats in zip(token_ids_list, features_list))

    def sequences(self) -> list[BufferedSequence]:
        """The stored sequences, oldest first (a snapshot: later adds do not change it)."""
        return list(self._sequences)
