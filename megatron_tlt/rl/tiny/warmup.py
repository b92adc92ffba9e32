"""Supervised warm-up of the tiny default policy before RL (cached by the caller: ``rl/tiny/tiny_source.py``).

A from-scratch policy never answers correctly, so RL would see only zero rewards. A short
supervised phase on worked solutions of the task, through the same Megatron model, DDP and
optimizer that RL then uses, gives a policy that is right sometimes: the starting point GRPO needs.
The loss covers the solution tokens only; each data-parallel rank takes its slice of every batch.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_tlt import atomic_files
from megatron_tlt.config import TLTConfig, build_options
from megatron_tlt.device import module_device, to_device
from megatron_tlt.formats.architecture import PolicyArchitecture
from megatron_tlt.formats.tokenizer import Tokenizer
from megatron_tlt.model import mcore, policy
from megatron_tlt.model.lm_training import LMMicroBatch, length_sorted_chunks, lm_train_step
from megatron_tlt.rl.inputs import policy_source
from megatron_tlt.rl.run import checkpoint
from megatron_tlt.rl.tiny import tiny_default

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmupSchedule:
    steps: int
    sequences_per_step: int
    micro_batch_size: int
    lr: float
    seed: int


def length_sorted_microbatches(sequences: Sequence[tuple[list[int], int]], micro_batch_size: int, pad_id: int,
                               *, same_length: bool, device: torch.device,
                               input_multiple: int = 1) -> list[LMMicroBatch]:
    """Micro-batches of (ids, prompt length) pairs on ``device``, sorted by length so padding stays small;
    the loss mask covers the tokens after the prompt. ``same_length`` pads all to one length (PP > 1);
    widths follow ``token_width(.., input_multiple)``. Rows are written on the host; each finished tensor
    moves once."""
    batches = []
    for chunk, width in length_sorted_chunks(sequences, lambda pair: len(pair[0]), micro_batch_size,
                                             same_width=same_length, input_multiple=input_multiple):
        tokens = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, (ids, prompt_len) in enumerate(chunk):
            tokens[row, : len(ids)] = torch.tensor(ids)
            mask[row, prompt_len : len(ids)] = 1
        batches.append(to_device(LMMicroBatch(tokens_bs=tokens, loss_mask_bs=mask), device))
    return batches


def run_warmup(model: torch.nn.Module, optimizer, corpus: Sequence[tuple[list[int], int]], schedule: WarmupSchedule, *,
               vocab_size: int, pad_id: int, dp_rank: int, dp_size: int,
               on_step: Callable[[int, float | None], None] | None = None) -> list[float]:
    """Train ``model`` on ``corpus`` for ``schedule.steps`` steps (collective); returns the loss per step
    on the last pipeline stage. Every rank draws the same global batch and keeps its DP slice."""
    if schedule.sequences_per_step % dp_size:
        raise ValueError(f"warmup.sequences_per_step {schedule.sequences_per_step} is not divisible by the "
                         f"data-parallel size {dp_size}")
    scheduler = mcore.build_lr_scheduler(optimizer, lr=schedule.lr, warmup_steps=max(1, schedule.steps // 10),
                                         total_steps=schedule.steps)
    rng = random.Random(schedule.seed)
    per_rank = schedule.sequences_per_step // dp_size
    same_length = mcore.stage_info().pp_size > 1
    device = module_device(model)
    input_multiple = mcore.sequence_multiple(model)
    losses = []
    started = time.perf_counter()
    for step in range(schedule.steps):
        batch = rng.sample(range(len(corpus)), schedule.sequences_per_step)
        mine = [corpus[i] for i in batch[dp_rank * per_rank : (dp_rank + 1) * per_rank]]
        microbatches = length_sorted_microbatches(mine, schedule.micro_batch_size, pad_id, same_length=same_length,
                                                  device=device, input_multiple=input_multiple)
        loss = lm_train_step(model, optimizer, microbatches, vocab_size=vocab_size)
        scheduler.step(1)
        if loss is not None:
            losses.append(loss)
        if on_step is not None:
            on_step(step, loss)
    logger.info("warm-up: %d steps in %.1fs, loss %.3f -> %.3f", schedule.steps, time.perf_counter() - started,
                losses[0] if losses else float("nan"), losses[-1] if losses else float("nan"))
    return losses


def warm_up_tiny_policy(config: TLTConfig, tokenizer: Tokenizer, arch: PolicyArchitecture, final: Path, *,
                        show_progress: bool) -> None:
    """Build the tiny policy from Megatron's initialisation, warm it up and publish it at ``final``."""
    model = policy.build_policy(arch, dtype=config.model.dtype, padded_vocab_size=arch.padded_vocab_size(
        mcore.stage_info().tp_size), per_token_loss=True, options=build_options(config))
    ddp = mcore.wrap_ddp(model)
    optimizer = mcore.build_optimizer(ddp, lr=config.warmup.lr, weight_decay=0.0, clip_grad=1.0)
    schedule = WarmupSchedule(steps=config.warmup.steps, sequences_per_step=config.warmup.sequences_per_step,
                              micro_batch_size=config.warmup.micro_batch_size, lr=config.warmup.lr,
                              seed=config.trainer.seed)
    corpus = tiny_default.warmup_sequences(tokenizer, config.warmup.corpus_size,
                                           config.warmup.other_answer_format_share, tiny_default.TaskShape.of(config),
                                           check_share=config.warmup.check_share,
                                           max_solution_tokens=config.rollout.max_response_tokens)
    progress = None
    if show_progress:
        from tqdm.auto import tqdm

        from megatron_tlt.rank_logs import console

        # leave=False: once the warm-up is done the RL steps' bar is the console's only one
        progress = tqdm(total=schedule.steps, desc="supervised warm-up (cached for later runs)", unit="step",
                        dynamic_ncols=True, file=console(), leave=False)

    def on_step(step: int, loss: float | None) -> None:
        if progress is not None:
            progress.update(1)
            if loss is not None:
                progress.set_postfix(loss=f"{loss:.3f}", refresh=False)

    run_warmup(ddp, optimizer, corpus, schedule, vocab_size=arch.vocab_size, pad_id=tokenizer.pad_id,
               dp_rank=mcore.data_parallel_rank(), dp_size=mcore.data_parallel_size(), on_step=on_step)
    if progress is not None:
        progress.close()
    # Same staging name on every rank (the save is collective), unique to this cache entry.
    staging = atomic_files.staging_path(final)
    if dist.get_rank() == 0:
        atomic_files.remove(staging)
    dist.barrier()
    policy.save_policy_checkpoint(ddp, staging, policy_source.checkpoint_meta(arch, config.model.dtype))
    # Kept so RL can continue this optimizer (see RLTrainer): its second moments scale RL's first steps.
    checkpoint.save_optimizer_state(staging, optimizer, mcore.data_parallel_rank())
    dist.barrier()
    if dist.get_rank() == 0:
        atomic_files.publish(staging, final, if_exists="keep")  # another process made it first: keep theirs
    dist.barrier()
