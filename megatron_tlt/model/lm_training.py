"""Next-token (supervised) training of the policy through Megatron's schedule, DDP and optimizer.

Used to check that Megatron training runs on this machine at any layout, and by the supervised
warm-up of the tiny default. Loss: token cross-entropy over the tokens whose loss mask is 1,
computed on vocab-parallel logits (never gathered). The loss function hands Megatron a (sum, count)
pair: with ``calculate_per_token_loss`` on, Megatron normalises by the tokens of the whole global
batch (all micro-batches, all data-parallel ranks); off, by each micro-batch's own count, averaged.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from megatron_tlt.device import module_device, to_device
from megatron_tlt.model import mcore

T = TypeVar("T")


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
        loss_sum = (token_loss * mask).sum()
        num_tokens = mask.sum().to(torch.int)
        mean = loss_sum.detach() / num_tokens.clamp(min=1)
        return loss_sum, num_tokens, {"lm_loss": mean}

    return output, loss_fn


def token_width(longest: int, input_multiple: int = 1) -> int:
    """The width to pad token rows of up to ``longest`` tokens to. The model reads all but the last token
    (a label only), and that input length must be a multiple of ``input_multiple``
    (``mcore.sequence_multiple``: the TP size with sequence parallelism); the extra positions are right
    padding, hidden from real positions by causal attention and masked out of every loss."""
    return longest + (1 - longest) % input_multiple


def length_sorted_chunks(items: Sequence[T], length: Callable[[T], int], micro_batch_size: int, *,
                         same_width: bool, input_multiple: int = 1,
                         max_tokens: int | None = None) -> list[tuple[list[T], int]]:
    """``items`` sorted by ``length`` and cut into micro-batches of at most ``micro_batch_size``, each with the
    width to pad it to (``token_width``): of its own longest item (little padding), or of the longest
    overall when ``same_width`` (pipeline stages need one shape). With ``max_tokens`` a micro-batch also
    holds at most that many padded tokens (at least one item): the short answers of a long-tail batch go many
    to a micro-batch, the tail few to one."""
    ordered = sorted(items, key=length)
    longest = max((length(item) for item in ordered), default=0)

    def width(chunk_longest: int) -> int:
        return token_width(longest if same_width else chunk_longest, input_multiple)

    chunks: list[list[T]] = []
    for item in ordered:  # ascending: the item joining a chunk is its longest
        chunk = chunks[-1] if chunks else None
        if (chunk is None or len(chunk) == micro_batch_size
                or (max_tokens is not None and (len(chunk) + 1) * width(length(item)) > max_tokens)):
            chunks.append([item])
        else:
            chunk.append(item)
    return [(chunk, width(length(chunk[-1]))) for chunk in chunks]


def check_microbatch_shapes(shapes: list[tuple[int, ...]], input_multiple: int = 1) -> None:
    """Pipeline stages exchange activations of one static shape: micro-batches must agree then. With
    sequence parallelism the model input (width - 1 tokens) must split evenly over the TP ranks."""
    if mcore.stage_info().pp_size > 1 and len(set(shapes)) > 1:
        raise ValueError(f"pipeline parallelism needs micro-batches of one shape; got {sorted(set(shapes))}")
    if any((shape[1] - 1) % input_multiple for shape in shapes):
        raise ValueError(f"sequence parallelism needs token widths w with w - 1 a multiple of {input_multiple} "
                         f"(pad with lm_training.token_width); got {sorted({shape[1] for shape in shapes})}")


def lm_train_step(model: torch.nn.Module, optimizer, microbatches: list[LMMicroBatch], *,
                  vocab_size: int) -> float | None:
    """One optimizer step over ``microbatches`` (gradient accumulation across them).

    Collective over all ranks. Micro-batches may differ in length when PP = 1, and sit on any device
    (they move to the model's); with sequence parallelism their widths follow ``token_width``. Returns the
    mean micro-batch loss on the last pipeline stage (None elsewhere).
    """
    check_microbatch_shapes([tuple(mb.tokens_bs.shape) for mb in microbatches], mcore.sequence_multiple(model))
    device = module_device(model)
    microbatches = [to_device(mb, device) for mb in microbatches]
    model.train()
    model.zero_grad_buffer()
    optimizer.zero_grad()
    reports = mcore.run_schedule(model, functools.partial(_forward_step, vocab_size=vocab_size), microbatches,
                                 seq_length=max(mb.tokens_bs.shape[1] for mb in microbatches) - 1,
                                 micro_batch_size=max(mb.tokens_bs.shape[0] for mb in microbatches),
                                 forward_only=False)
    update_ok, _grad_norm, _ = optimizer.step()
    if not update_ok:
        raise FloatingPointError("optimizer step skipped: gradients overflowed")
    if not reports:
        return None
    return torch.stack([r["lm_loss"] for r in reports]).mean().item()
