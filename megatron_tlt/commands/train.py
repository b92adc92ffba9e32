"""``tlt train`` on one rank: the parallel layout, the RL trainer, and their clean-up."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from megatron_tlt.config import TLTConfig
from megatron_tlt.parallel import ParallelLayout
from megatron_tlt.rl.trainer import RLTrainer


def train_on_rank(config: TLTConfig, run_dir: str, resume: bool) -> list[dict] | None:
    """Entry point of every rank (launched by ``commands/start.start_run``); summary records on rank 0."""
    layout = ParallelLayout(tensor_parallel_size=config.parallel.tensor_parallel_size,
                            pipeline_parallel_size=config.parallel.pipeline_parallel_size,
                            seed=config.trainer.seed).initialize()
    dist.barrier()  # under torchrun, rank 0 has prepared the run directory (commands/start.py: start_run)
    trainer = None
    try:
        trainer = RLTrainer(config, Path(run_dir), layout, resume=resume)
        return trainer.run()
    finally:
        if trainer is not None:
            trainer.close()
        layout.close()
