"""Next-token (supervised) training of the policy through Megatron's schedule, DDP and optimizer.

Used to check that Megatron training runs on this machine at any layout, and by the supervised
warm-up of the tiny default. Loss: mean token cross-entropy over the tokens whose loss mask is 1,
computed on vocab-parallel logits (never gathered).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from megatron_tlt import mcore


@dataclasses.dataclass(frozen=True)
class LMMicroBatch:
    """One micro-batch: tokens [b, s]; the loss predicts tokens[:, 1:] where loss_mask[:, 1:] == 1."""

    tokens_bs: torch.Tensor
    loss_mask_bs: torch.Tensor


def _forward_step(data_iterator, model, *, vocab_size: int):
    batch: LMMicroBatch = next(data_iterator)
    inputs = batch.tokens_bs[:, :-1].contiguous()
    labels = batch.tokens_bs[:, 1:].contiguous()
    mask = batch.loss_mask_bs[:, 1:].float()
    output = model(inputs, mcore.position_ids_like(inputs), None)

    def loss_fn(logits_bsv: torch.Tensor):
        token_loss = mcore.vocab_parallel_cross_entropy(logits_bsv, labels, vocab_size)
        loss = (token_loss * mask).sum() / mask.sum().clamp(min=1.0)
        # clone: the schedule later divides `loss` in place by the number of micro-batches
        return loss, {"lm_loss": loss.detach().clone()}

    return output, loss_fn


def lm_train_step(model: torch.nn.Module, optimizer, microbatches: list[LMMicroBatch], *,
                  vocab_size: int) -> float | None:
    """One optimizer step over ``microbatches`` (gradient accumulation across them).

    Collective over all ranks. Returns the mean micro-batch loss on the last pipeline stage
    (None elsewhere); gradients are averaged over data-parallel replicas by Megatron's DDP.
    """
    model.train()
    model.zero_grad_buffer()
    optimizer.zero_grad()
    b, s = microbatches[0].tokens_bs.shape
    reports = mcore.run_schedule(model, functools.partial(_forward_step, vocab_size=vocab_size), microbatches, seq_length=s - 1, micro_batch_size=b,
                                 forward_only=False)
    update_ok, _grad_norm, _ = optimizer.step()
    if not update_ok:
        raise FloatingPointError("optimizer step skipped: gradients overflowed")
    if not reports:
        return None
    return torch.stack([r["lm_loss"] for r in reports]).mean().item()
