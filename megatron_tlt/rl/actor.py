"""The actor's Megatron passes over rollouts: per-token log-probs, and the hidden states the drafter learns from.

Sequences (prompt + response token ids) are right-padded into micro-batches; causal attention makes
the padding invisible to the real positions. Log-probs come from vocab-parallel logits without
gathering the vocabulary (log p = -cross-entropy). The same forward captures, through a hook on the
final RMSNorm, the last hidden state *after* that norm: exactly the feature vLLM hands its EAGLE
drafter at serving time (DESIGN.md section 4, trap 1), so training and serving see the same tensor
and no second forward is needed. With pipeline parallelism the last stage shares the features with
the other stages (``features_on_every_stage``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from megatron_tlt.device import module_device, to_device
from megatron_tlt.model import mcore
from megatron_tlt.model.lm_training import length_sorted_chunks, token_width


@dataclasses.dataclass
class CapturedFeatures:
    """The drafter features a pass over rollouts kept. They exist on the last pipeline stage only, on the
    model's device (the drafter trains there); which sequences have features is known on every stage (it
    follows from their lengths)."""

    feature_indices: list[int] = dataclasses.field(default_factory=list)
    """The sequences whose drafter features were kept: the newest that fit ``max_feature_rows``."""
    feature_rows: list[int] = dataclasses.field(default_factory=list)
    """Rows of each kept sequence's features: its length - 1."""
    features: torch.Tensor | None = None
    """The kept sequences' post-final-norm hidden states at positions 0 .. len-2, one flat
    [sum(feature_rows), hidden] tensor in ``feature_indices`` order (the last token's feature would
    draft a token after the sequence, which no example needs). None off the last stage."""

    @property
    def hidden_states(self) -> list[torch.Tensor] | None:
        """The features split per kept sequence (views, no copy)."""
        return None if self.features is None else list(torch.split(self.features, self.feature_rows))


@dataclasses.dataclass
class LogProbResult(CapturedFeatures):
    """Outputs of the log-prob pass: its features, and the log-probs (last pipeline stage only)."""

    token_logprobs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """For sequence i, log p(token t+1 | tokens <= t) for t = 0 .. len-2: shape [len_i - 1]."""


def pad_sequences(sequences: Sequence[Sequence[int]], pad_id: int, *, device: torch.device,
                  input_multiple: int = 1) -> torch.Tensor:
    """[b, width] token ids, right-padded with ``pad_id`` to ``token_width`` of the longest (``input_multiple``:
    ``mcore.sequence_multiple``): built on the host, moved to ``device`` whole."""
    width = token_width(max(len(s) for s in sequences), input_multiple)
    tokens_bs = torch.tensor([list(s) + [pad_id] * (width - len(s)) for s in sequences], dtype=torch.long)
    return to_device(tokens_bs, device)


class FeatureCapture:
    """Keeps the drafter features of a Megatron pass over ``sequences`` run in micro-batches ``batches``
    (lists of sequence indices, in the order the schedule runs them): a forward hook on
    ``decoder.final_layernorm`` copies the kept sequences' rows of its output ([s, b, h], sequence-first;
    one call per micro-batch) into one preallocated tensor, detached (the update's forward records a graph).

    Only what the drafter buffer would keep is ever held (``max_feature_rows``; None: all): a step's rollouts
    are far larger than the buffer at scale (70B: 256 sequences per replica, ~12 GiB in bf16 at a 3k-token
    average, 36 GiB at 9k). With sequence parallelism the norm's output is this TP rank's slice of the
    sequence: the slices are gathered first (every TP rank of the last stage runs the hook on the same
    micro-batches, in lockstep). Use as a context manager around the pass; ``result()`` after it.
    """

    def __init__(self, model: torch.nn.Module, sequences: Sequence[Sequence[int]], batches: list[list[int]],
                 max_feature_rows: int | None, *, enabled: bool = True):
        self.model = model
        self.kept: list[int] = []
        if enabled:
            self.kept = list(range(len(sequences))) if max_feature_rows is None else newest_that_fit(sequences,
                                                                                                   max_feature_rows)
        self.rows = [len(sequences[i]) - 1 for i in self.kept]
        place = {i: (b, j) for b, batch in enumerate(batches) for j, i in enumerate(batch)}
        self.rows_by_batch: list[list[tuple[int, int, int]]] = [[] for _ in batches]
        offset = 0
        for i, n in zip(self.kept, self.rows):
            b, j = place[i]
            self.rows_by_batch[b].append((j, offset, n))
            offset += n
        self.out, self.batch, self._handle = None, 0, None
        if self.kept and mcore.stage_info().is_last_stage:
            self.out = _feature_buffer(model, offset)

    def __enter__(self) -> FeatureCapture:
        if self.out is not None:
            self._handle = mcore.unwrap(self.model).decoder.final_layernorm.register_forward_hook(self._keep)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()

    def _keep(self, module, inputs, output_sbh):
        kept = self.rows_by_batch[self.batch]
        self.batch += 1
        if not kept:  # the same on every TP rank: all skip the gather together
            return
        full_sbh = mcore.full_sequence(output_sbh.detach(), self.model)
        for j, offset, rows in kept:
            self.out[offset:offset + rows].copy_(full_sbh[:rows, j])

    def result(self) -> CapturedFeatures:
        if self._handle is not None and self.batch != len(self.rows_by_batch):  # rows would be misplaced
            raise RuntimeError(f"the final norm ran {self.batch} times for {len(self.rows_by_batch)} micro-batches")
        return CapturedFeatures(feature_indices=self.kept, feature_rows=self.rows, features=self.out)


def _feature_buffer(model: torch.nn.Module, rows: int) -> torch.Tensor:
    """Uninitialised [rows, hidden] in the policy's dtype and device: what every stage holds the features in."""
    config = mcore.unwrap(model).config
    return torch.empty(rows, config.hidden_size, dtype=config.params_dtype, device=module_device(model))


@torch.no_grad()
def compute_logprobs(model: torch.nn.Module, sequences: Sequence[Sequence[int]], *, vocab_size: int,
                     micro_batch_size: int, pad_id: int = 0, capture_hidden: bool = False,
                     max_feature_rows: int | None = None, micro_batch_tokens: int | None = None) -> LogProbResult:
    """Log-probs of every next token (and optionally the drafter features) for ``sequences``.

    With ``capture_hidden`` the features of the newest sequences that fit ``max_feature_rows`` (None: all)
    are kept, what a drafter buffer of that size would keep of them. Collective over the model-parallel
    ranks: every rank of a pipeline/tensor group must call it with the same sequences.
    """
    model.eval()
    # Length-sorted micro-batches pad little: a GRPO batch mixes short answers with the long tail.
    device = module_device(model)
    input_multiple = mcore.sequence_multiple(model)
    index_batches = [chunk for chunk, _ in length_sorted_chunks(
        range(len(sequences)), lambda i: len(sequences[i]), micro_batch_size, same_width=False,
        input_multiple=input_multiple, max_tokens=micro_batch_tokens)]
    order = [i for batch in index_batches for i in batch]  # the sequences in sorted order
    batches = [[sequences[i] for i in batch] for batch in index_batches]
    padded = [pad_sequences(batch, pad_id, device=device, input_multiple=input_multiple) for batch in batches]
    capture = FeatureCapture(model, sequences, index_batches, max_feature_rows, enabled=capture_hidden)
    per_batch: list[torch.Tensor] = []

    def forward_step(data_iterator, stage_model):
        tokens = next(data_iterator)
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        output = stage_model(inputs, mcore.position_ids_like(inputs), None)

        def loss_fn(logits_bsv: torch.Tensor):
            per_batch.append(-mcore.vocab_parallel_cross_entropy(logits_bsv, labels, vocab_size))
            return logits_bsv.new_zeros(()), {}

        return output, loss_fn

    with capture:
        # Micro-batches differ in length: run them one schedule call each (shapes are static per call).
        for tokens in padded:
            b, s = tokens.shape
            mcore.run_schedule(model, forward_step, [tokens], seq_length=s - 1, micro_batch_size=b, forward_only=True)
    features = capture.result()
    kept = dict(feature_indices=features.feature_indices, feature_rows=features.feature_rows, features=features.features)
    if not mcore.stage_info().is_last_stage:
        return LogProbResult(**kept)
    position = {i: p for p, i in enumerate(order)}  # sequence index -> place in sorted order
    sorted_logprobs = [row[: len(seq) - 1] for batch_lp, batch in zip(per_batch, batches)
                       for row, seq in zip(batch_lp, batch)]
    return LogProbResult(**kept, token_logprobs=[sorted_logprobs[position[i]] for i in range(len(sequences))])


def newest_that_fit(sequences: Sequence[Sequence[int]], max_rows: int) -> list[int]:
    """Indices of the newest sequences whose feature rows (len - 1 each) fit ``max_rows`` together: what
    a drafter buffer of that size keeps of them. A sequence larger than the whole budget is skipped."""
    kept, total = [], 0
    for i in reversed(range(len(sequences))):
        rows = len(sequences[i]) - 1
        if rows > max_rows:
            continue
        if total + rows > max_rows:
            break
        kept.append(i)
        total += rows
    return kept[::-1]


def features_on_every_stage(model: torch.nn.Module, sequences: Sequence[Sequence[int]],
                            result: CapturedFeatures) -> tuple[list[Sequence[int]], list[torch.Tensor]]:
    """The drafter's features on every pipeline stage, so that idle ranks of every stage can train it.

    Only the last stage computes them; it broadcasts its flat feature tensor (already cut to what the
    drafter buffer keeps) to the other stages of its pipeline group, whose shape every stage knows from
    ``result.feature_rows``. Collective over the pipeline group; returns (the sequences kept, their
    features) on every stage.
    """
    kept, rows = result.feature_indices, result.feature_rows
    if not kept:  # every stage knows it: nothing to send
        return [], []
    flat = result.features
    stage = mcore.stage_info()
    if stage.pp_size > 1:
        if not stage.is_last_stage:
            flat = _feature_buffer(model, sum(rows))
        group = mcore.pipeline_parallel_group()
        torch.distributed.broadcast(flat, src=torch.distributed.get_global_rank(group, stage.pp_size - 1), group=group)
    return [sequences[i] for i in kept], list(torch.split(flat, rows))
