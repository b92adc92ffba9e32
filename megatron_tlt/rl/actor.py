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

from megatron_tlt import mcore


@dataclasses.dataclass
class LogProbResult:
    """Per-sequence outputs of the log-prob pass (on the last pipeline stage; empty elsewhere)."""

    token_logprobs: list[torch.Tensor]
    """For sequence i, log p(token t+1 | tokens <= t) for t = 0 .. len-2: shape [len_i - 1]."""
    hidden_states: list[torch.Tensor] | None
    """For sequence i, the post-final-norm hidden state at positions 0 .. len-2: [len_i - 1, hidden]
    (the last token's feature would draft a token after the sequence, which no example needs)."""


def _pad(sequences: Sequence[Sequence[int]], pad_id: int) -> torch.Tensor:
    longest = max(len(s) for s in sequences)
    return torch.tensor([list(s) + [pad_id] * (longest - len(s)) for s in sequences], dtype=torch.long)


class _FinalNormCapture:
    """Forward hook on ``decoder.final_layernorm``: keeps its output ([s, b, h], sequence-first)."""

    def __init__(self, model: torch.nn.Module):
        self.outputs: list[torch.Tensor] = []
        self._handle = mcore.unwrap(model).decoder.final_layernorm.register_forward_hook(self._keep)

    def _keep(self, module, inputs, output):
        self.outputs.append(output.detach())

    def remove(self) -> None:
        self._handle.remove()


@torch.no_grad()
def compute_logprobs(model: torch.nn.Module, sequences: Sequence[Sequence[int]], *, vocab_size: int,
                     micro_batch_size: int, pad_id: int = 0, capture_hidden: bool = False) -> LogProbResult:
    """Log-probs of every next token (and optionally the drafter features) for ``sequences``.

    Collective over the model-parallel ranks: every rank of a pipeline/tensor group must call it
    with the same sequences.
    """
    model.eval()
    batches = [sequences[i : i + micro_batch_size] for i in range(0, len(sequences), micro_batch_size)]
    padded = [_pad(batch, pad_id) for batch in batches]
    stage = mcore.stage_info()
    capture = _FinalNormCapture(model) if capture_hidden and stage.is_last_stage else None
    per_batch: list[torch.Tensor] = []

    def forward_step(data_iterator, stage_model):
        tokens = next(data_iterator)
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        output = stage_model(inputs, mcore.position_ids_like(inputs), None)

        def loss_fn(logits_bsv: torch.Tensor):
            per_batch.append(-mcore.vocab_parallel_cross_entropy(logits_bsv, labels, vocab_size))
            return logits_bsv.new_zeros(()), {}

        return output, loss_fn

    try:
        # Micro-batches differ in length: run them one schedule call each (shapes are static per call).
        for tokens in padded:
            b, s = tokens.shape
            mcore.run_schedule(model, forward_step, [tokens], seq_length=s - 1, micro_batch_size=b, forward_only=True)
    finally:
        if capture is not None:
            capture.remove()
    if not stage.is_last_stage:
        return LogProbResult(token_logprobs=[], hidden_states=None)
    token_logprobs = [row[: len(seq) - 1] for batch_lp, batch in zip(per_batch, batches)
                      for row, seq in zip(batch_lp, batch)]
    hidden = None
    if capture is not None:
        # The hook saw inputs[:, :-1]: features for positions 0 .. len-2; the last token's feature
        # is never needed (no next token to draft).
        hidden = [capture.outputs[k][: len(seq) - 1, j] for k, batch in enumerate(batches)
                  for j, seq in enumerate(batch)]
    return LogProbResult(token_logprobs=token_logprobs, hidden_states=hidden)


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
                            hidden_states: list[torch.Tensor] | None, *,
                            max_rows: int) -> tuple[list[Sequence[int]], list[torch.Tensor]]:
    """The drafter's features on every pipeline stage, so that idle ranks of every stage can train it.

    Only the last stage computes them; it broadcasts those of the newest sequences that fit ``max_rows``
    (the drafter buffer's budget: it would drop the rest) to the other stages of its pipeline group, in
    one flat tensor whose shape every stage knows from the sequence lengths. Collective over the
    pipeline group; returns (the sequences kept, their features) on every stage.
    """
    stage = mcore.stage_info()
    if stage.pp_size == 1:
        return list(sequences), list(hidden_states or [])
    kept = newest_that_fit(sequences, max_rows)
    rows = [len(sequences[i]) - 1 for i in kept]
    if not kept:  # every stage knows it: nothing to send
        return [], []
    if stage.is_last_stage:
        flat = torch.cat([hidden_states[i] for i in kept])
    else:
        core = mcore.unwrap(model)
        flat = torch.empty(sum(rows), core.config.hidden_size, dtype=core.config.params_dtype,
                           device=next(core.parameters()).device)
    group = mcore.pipeline_parallel_group()
    torch.distributed.broadcast(flat, src=torch.distributed.get_global_rank(group, stage.pp_size - 1), group=group)
    return [sequences[i] for i in kept], list(torch.split(flat, rows))
