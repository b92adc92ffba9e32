"""EAGLE training examples from captured sequences, packed into bounded micro-batches that keep boundaries.

The pairing (EAGLE; DESIGN.md section 4). A sequence has tokens x_0 .. x_{L-1} and the policy's post-final-norm
hidden states f_0 .. f_{n-1} (the log-prob pass captures n = L - 1 of them; n = L is accepted too). The example
at position t, for t = 0 .. n-2, is

    input:  embed(x_{t+1}) and f_t        (the token *after* the feature's position: the token that f_t predicted)
    target: f_{t+1}                        (whose LM-head distribution is the policy's p(x_{t+2} | x_<=t+1))
    position id: t                         (vLLM runs the drafter at the target position of f_t)

so a sequence gives n - 1 examples. Pairing x_t with f_t instead (the published TLT online trainer appears to)
teaches the drafter a different function from the one vLLM calls.

Packing. Sequences go into packs of at most ``max_tokens`` examples, first fit in input order. Each piece is a
segment: its rows are contiguous and ``segment_ids_t`` numbers them 0, 1, ... within the pack, and position ids
restart at 0 with every new sequence. A sequence with more than ``max_tokens`` examples is split into
consecutive chunks of ``max_tokens`` (the last one shorter); each chunk is its own segment and keeps its true
positions. Nothing is dropped, but a chunk after the first cannot attend to the earlier chunks, so its rows
see less context than vLLM gives them: choose ``max_tokens`` above the usual sequence length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor


def sequence_tensors(token_ids: Sequence[int] | Tensor, features_th: Tensor) -> tuple[Tensor, Tensor]:
    """``token_ids`` as a 1-D long tensor, after checking it fits ``features_th`` [n, hidden], n in {L-1, L}."""
    ids_t = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    if features_th.dim() != 2:
        raise ValueError(f"features must be [tokens, hidden], got shape {tuple(features_th.shape)}")
    num_tokens, num_features = ids_t.numel(), features_th.shape[0]
    if num_features not in (num_tokens - 1, num_tokens):
        raise ValueError(f"a sequence of {num_tokens} tokens needs {num_tokens - 1} (or {num_tokens}) feature rows, "
                         f"got {num_features}")
    return ids_t, features_th


@dataclasses.dataclass(frozen=True)
class EagleExamples:
    """Training rows of one sequence (or a chunk of it), in position order."""

    input_ids_t: Tensor
    """x_{t+1}: the token whose (current) policy embedding the drafter reads next to f_t."""
    features_th: Tensor
    """f_t: the policy's post-final-norm hidden state at position t."""
    target_features_th: Tensor
    """f_{t+1}: what the drafter predicts."""
    position_ids_t: Tensor
    """t."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids_t.numel()

    def rows(self, start: int, stop: int) -> EagleExamples:
        return EagleExamples(self.input_ids_t[start:stop], self.features_th[start:stop],
                             self.target_features_th[start:stop], self.position_ids_t[start:stop])


def eagle_examples(token_ids: Sequence[int] | Tensor, features_th: Tensor) -> EagleExamples:
    """The EAGLE pairing of one sequence (module docstring): n - 1 rows for n feature rows."""
    ids_t, features_th = sequence_tensors(token_ids, features_th)
    num_examples = max(features_th.shape[0] - 1, 0)
    return EagleExamples(
        input_ids_t=ids_t[1 : num_examples + 1],
        features_th=features_th[:num_examples],
        target_features_th=features_th[1 : num_examples + 1],
        position_ids_t=torch.arange(num_examples, dtype=torch.long),
    )


@dataclasses.dataclass
class DrafterPack:
    """One packed micro-batch of drafter training rows; attention must stay within a segment."""

    input_ids_t: Tensor
    features_th: Tensor
    target_features_th: Tensor
    position_ids_t: Tensor
    segment_ids_t: Tensor
    """0, 1, ... per segment; a segment is a contiguous run of rows from one sequence (or chunk)."""
    sequence_index_s: list[int]
    """For each segment, the index (in the packed input) of the sequence it came from."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids_t.numel()

    def to(self, device) -> DrafterPack:
        tensors = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sequence_index_s"}
        return DrafterPack(**{name: t.to(device) for name, t in tensors.items()},
                           sequence_index_s=list(self.sequence_index_s))


def _concat(pieces: list[tuple[int, EagleExamples]]) -> DrafterPack:
    examples = [piece for _, piece in pieces]
    segment_ids_t = torch.cat([torch.full((p.num_tokens,), s, dtype=torch.long) for s, p in enumerate(examples)])
    return DrafterPack(
        input_ids_t=torch.cat([p.input_ids_t for p in examples]),
        features_th=torch.cat([p.features_th for p in examples]),
        target_features_th=torch.cat([p.target_features_th for p in examples]),
        position_ids_t=torch.cat([p.position_ids_t for p in examples]),
        segment_ids_t=segment_ids_t,
        sequence_index_s=[index for index, _ in pieces],
    )


def iter_packs(sequences: Iterable[tuple[Sequence[int] | Tensor, Tensor]], max_tokens: int, *,
               open_packs: int | None = None) -> Iterator[DrafterPack]:
    """Packs of at most ``max_tokens`` rows from ``(token_ids, features_th)`` pairs (module docstring),
    made as they are asked for.

    First fit over the packs still open; with ``open_packs`` set, once that many are open the oldest is
    closed and yielded before a new one opens, so only the packs consumed are ever built (their rows
    copied). Sequences with fewer than two feature rows give no example and are skipped.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    packs: list[list[tuple[int, EagleExamples]]] = []
    room: list[int] = []
    for index, (token_ids, features_th) in enumerate(sequences):
        examples = eagle_examples(token_ids, features_th)
        for start in range(0, examples.num_tokens, max_tokens):
            piece = examples.rows(start, start + max_tokens)
            slot = next((k for k, free in enumerate(room) if free >= piece.num_tokens), None)
            if slot is None:
                if open_packs is not None and len(packs) >= open_packs:
                    yield _concat(packs.pop(0))
                    room.pop(0)
                packs.append([])
                room.append(max_tokens)
                slot = len(packs) - 1
            packs[slot].append((index, piece))
            room[slot] -= piece.num_tokens
    for pieces in packs:
        yield _concat(pieces)


def pack_sequences(sequences: Iterable[tuple[Sequence[int] | Tensor, Tensor]], max_tokens: int) -> list[DrafterPack]:
    """Every pack at once: first fit over all of them (``iter_packs`` without a bound)."""
    return list(iter_packs(sequences, max_tokens))


def pad_rows(pack: DrafterPack, multiple: int) -> DrafterPack:
    """``pack`` with rows appended up to a multiple of ``multiple`` rows (FP8 GEMMs need row counts divisible
    by 16), on the pack's device; the pack itself when it already fits. The extra rows are a segment of their
    own after the real ones (not in ``sequence_index_s``), so no real row attends to them; they hold token 0,
    zero features and position 0, and the caller cuts them off before the loss."""
    extra = -pack.num_tokens % multiple
    if extra == 0:
        return pack

    def padded(t: Tensor, value: int = 0) -> Tensor:
        return torch.cat([t, t.new_full((extra, *t.shape[1:]), value)])

    return DrafterPack(
        input_ids_t=padded(pack.input_ids_t), features_th=padded(pack.features_th),
        target_features_th=padded(pack.target_features_th), position_ids_t=padded(pack.position_ids_t),
        segment_ids_t=padded(pack.segment_ids_t, len(pack.sequence_index_s)),
        sequence_index_s=list(pack.sequence_index_s))
