"""A run's state across a restart: what a checkpoint gives back, what a step's checkpoint writes, and rank 0's
records with the steps past the checkpoint dropped."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from megatron_tlt.atomic_files import write_text_atomic
from megatron_tlt.config import RolloutEngineConfig, TLTConfig, to_yaml
from megatron_tlt.rl.inputs import policy_source
from megatron_tlt.rl.run import checkpoint, checkpoint_paths, metric_loggers, samples_log
from megatron_tlt.rl.run import run_dir as run_files

logger = logging.getLogger(__name__)


def restore(ckpt: Path, *, optimizer, sampler, lr_schedule, updates_per_step: int) -> tuple[int, dict]:
    """Load the optimizer, the prompt sampler, the RNGs and the LR schedule from ``ckpt``; returns (its step, the
    rest of its state)."""
    state = checkpoint.load_checkpoint_state(ckpt, optimizer=optimizer)
    sampler.load_state_dict(state["sampler"])
    checkpoint.set_rng_state(state["rng"])
    step = checkpoint_paths.checkpoint_step(ckpt)
    lr_schedule.step(step * updates_per_step)  # a function of the step
    return step, state


def save(config: TLTConfig, run_dir: Path, step: int, *, session, optimizer, sampler, engine, dp_rank: int) -> None:
    """The policy, its optimizer, the sampler and this rank's BEG-MAB at ``step`` (collective)."""
    checkpoint.save_checkpoint(run_dir, step, model=session.model, optimizer=optimizer,
                               meta=policy_source.checkpoint_meta(session.arch, config.model.dtype),
                               sampler_state=sampler.state_dict(), dp_rank=dp_rank,
                               keep=config.trainer.keep_checkpoints, rank_state={"bandit": engine.bandit_state()},
                               tokenizer_dir=session.tokenizer.directory)


def open_reporter(config: TLTConfig, run_dir: Path, start_step: int) -> run_files.RunReporter:
    """Rank 0's reporter, holding the records up to ``start_step``; the files' later steps are dropped."""
    records = [r for r in run_files.read_summary(run_dir) if r["step"] <= start_step]
    run_files.truncate_timeline(run_dir, start_step)
    samples_log.truncate(run_dir, start_step)
    return run_files.RunReporter(run_dir, total_steps=config.trainer.steps, start_step=start_step, records=records,
                                 loggers=metric_loggers.open_metric_loggers(config, run_dir, start_step=start_step))


def record_engine(config: TLTConfig, run_dir: Path, engine: RolloutEngineConfig) -> None:
    """The engine as the rank session sized it (its context length, its CPU KV cache) into the run's config.yaml,
    beside the values decided before the ranks started (``commands/run_values.py``)."""
    ran = dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, engine=engine))
    write_text_atomic(run_dir / run_files.CONFIG_FILE, to_yaml(ran))
