"""The actor's Megatron passes over rollouts: per-token log-probs, and the hidden states the drafter learns from.

Sequences (prompt + response token ids) are right-padded into micro-batches; causal attention makes
the padding invisible to the real positions. Log-probs come from vocab-parallel logits without
gathering the vocabulary (log p = -cross-entropy). The same forward captures, through a hook on the
final RMSNorm, the last hidden state *after* that norm: exactly the feature vLLM hands its EAGLE
drafter at serving time (DESIGN.md section 4, trap 1), so training and serving see the same tensor
and no second forward is needed.
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
