"""The policy's optimizer and learning-rate schedule for RL, continuing the warm-up's Adam where it can."""

from __future__ import annotations

import logging
from pathlib import Path

from megatron_tlt.config import TLTConfig
from megatron_tlt.model import mcore
from megatron_tlt.rl.run import checkpoint

logger = logging.getLogger(__name__)


def build(config: TLTConfig, model, initial_source: Path | None, *, resuming: bool, is_reporter: bool):
    """(optimizer, lr schedule); a new run with ``warmup.continue_optimizer`` starts from the warm-up's Adam."""
    opt = config.optimizer
    optimizer = mcore.build_optimizer(model, lr=opt.lr, weight_decay=opt.weight_decay, clip_grad=opt.clip_grad,
                                      adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2, min_lr=opt.min_lr)
    lr_schedule = mcore.build_lr_scheduler(
        optimizer, lr=opt.lr, min_lr=opt.min_lr, warmup_steps=opt.lr_warmup_steps,
        total_steps=config.trainer.steps * config.trainer.updates_per_step, style=opt.lr_decay_style)
    if not resuming and config.warmup.continue_optimizer:
        _continue_warmup_optimizer(config, optimizer, lr_schedule, initial_source, is_reporter=is_reporter)
    return optimizer, lr_schedule


def _continue_warmup_optimizer(config: TLTConfig, optimizer, lr_schedule, source: Path | None, *,
                               is_reporter: bool) -> None:
    """Start RL from the warm-up's Adam state, at RL's learning rate.

    A fresh Adam's first steps are sign-like: every weight moves by ~lr however noisy its gradient,
    and RL gradients from a few hundred samples are mostly noise for most weights of a tiny policy.
    The warm-up's second moments make RL's steps proportional to the gradient instead.
    """
    if config.optimizer.distributed:  # the warm-up's Adam is not sharded; RL's is
        if is_reporter and source is not None:
            logger.info("optimizer.distributed: RL starts with a fresh Adam (the warm-up's is not sharded)")
        return
    if source is None or not checkpoint.has_optimizer_state(source):
        if is_reporter and source is not None:
            logger.info("%s holds no optimizer state for this layout: RL starts with a fresh Adam", source)
        return
    checkpoint.load_optimizer_state(source, optimizer)
    opt = config.optimizer
    for group in optimizer.param_groups:  # the loaded groups carry the warm-up's learning rates
        group["max_lr"], group["min_lr"] = opt.lr, opt.min_lr
        group["lr"] = lr_schedule.get_lr(group)
