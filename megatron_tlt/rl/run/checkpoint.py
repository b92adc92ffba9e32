"""Atomic RL checkpoints: policy, optimizer, data position and RNG, so a killed run resumes exactly.

    checkpoints/step_000010/
        policy/                  Megatron distributed checkpoint + tlt_checkpoint.json (any TP/PP), and the
                                 policy's tokenizer files, so that `tlt convert` exports a servable model
        optimizer/tp0of1_pp0of1.pt  Adam state of each model-parallel shard (written by DP rank 0)
        trainer/rank0.pt         per rank: prompt sampler position and RNG states
        trainer.json             the step and layout; written last

Every rank writes into ``.step_000010.partial`` (``atomic_files.staging_path``); rank 0 renames it into
place after every rank has finished, so a directory named ``step_N`` is always complete; older ones are
then pruned (``atomic_files.prune_oldest``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_tlt import atomic_files
from megatron_tlt.formats.hf_io import CheckpointError, copy_tokenizer_files
from megatron_tlt.model import mcore, policy
from megatron_tlt.rl.run.checkpoint_paths import (
    OPTIMIZER_SUBDIR,
    POLICY_SUBDIR,
    TRAINER_META,
    list_checkpoints,
    step_dir,
)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(run_dir: Path, step: int, *, model, optimizer, meta: policy.PolicyCheckpointMeta,
                    sampler_state: dict, dp_rank: int, keep: int, rank_state: dict | None = None,
                    tokenizer_dir: Path | None = None) -> Path:
    """Collective over all ranks; returns the final directory. ``rank_state``: more of this rank's own
    state to keep beside its sampler position and RNG (e.g. its engine's bandit). ``tokenizer_dir``: where
    the run's tokenizer came from (``model.hf_dir``, or the tiny default's cache entry); its tokenizer files
    (``hf_io.TOKENIZER_FILES``, the chat template among them) are copied into the policy checkpoint."""
    final = step_dir(run_dir, step)
    staging = atomic_files.staging_path(final)  # the same on every rank: they all write into it
    rank = dist.get_rank()
    if rank == 0:
        atomic_files.remove(staging)  # left by a run killed mid-save
    dist.barrier()
    policy.save_policy_checkpoint(model, staging / POLICY_SUBDIR, meta)
    stage = mcore.stage_info()
    save_optimizer_state(staging, optimizer, dp_rank)
    (staging / "trainer").mkdir(parents=True, exist_ok=True)
    torch.save({"sampler": sampler_state, "rng": rng_state(), **(rank_state or {})}, staging / "trainer" / f"rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, staging / POLICY_SUBDIR)
        layout = {"tensor_parallel_size": stage.tp_size, "pipeline_parallel_size": stage.pp_size,
                  "world_size": dist.get_world_size()}
        (staging / TRAINER_META).write_text(json.dumps({"step": step, "layout": layout}, indent=2))
        atomic_files.publish(staging, final, if_exists="replace")  # a resumed run saving the same step again
        atomic_files.prune_oldest(list_checkpoints(run_dir), keep)
    dist.barrier()
    return final


def _optimizer_file(directory: Path, *, sharded_over_dp: bool = False) -> Path:
    # The layout is in the name: a shard's Adam state only fits the same TP x PP split (and, for the
    # distributed optimizer, whose state is split over DP too, the same DP size).
    stage = mcore.stage_info()
    name = f"tp{stage.tp_rank}of{stage.tp_size}_pp{stage.pp_rank}of{stage.pp_size}"
    if sharded_over_dp:
        name += f"_dp{mcore.data_parallel_rank()}of{mcore.data_parallel_size()}"
    return directory / OPTIMIZER_SUBDIR / f"{name}.pt"


def save_optimizer_state(directory: Path, optimizer, dp_rank: int) -> None:
    """This rank's Adam state under ``directory/optimizer/``: one file per model-parallel shard, written by DP
    rank 0 (the replicas hold the same), or one per rank with the distributed optimizer."""
    sharded = mcore.is_distributed_optimizer(optimizer)
    if dp_rank == 0 or sharded:
        path = _optimizer_file(directory, sharded_over_dp=sharded)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(mcore.optimizer_state(optimizer), path)


def has_optimizer_state(directory: Path, optimizer=None) -> bool:
    """Whether ``directory`` holds Adam state for this rank's shard at the current layout (and, given the
    optimizer, in its form: sharded over DP or not)."""
    sharded = optimizer is not None and mcore.is_distributed_optimizer(optimizer)
    return _optimizer_file(directory, sharded_over_dp=sharded).is_file()


def load_optimizer_state(directory: Path, optimizer) -> None:
    path = _optimizer_file(directory, sharded_over_dp=mcore.is_distributed_optimizer(optimizer))
    if not path.is_file():
        raise CheckpointError(f"{directory}: no optimizer state for this rank at this layout ({path.name}); a "
                              "distributed optimizer resumes at the same data-parallel size, and one saved without "
                              "optimizer.distributed cannot resume with it (nor the reverse)")
    mcore.load_optimizer_state(optimizer, torch.load(path, weights_only=False))


def load_checkpoint_state(ckpt: Path, *, optimizer) -> dict:
    """Load the optimizer (must be built for the same TP/PP layout) and return this rank's trainer
    state (sampler position and RNG). The policy itself is loaded by ``policy.load_policy_checkpoint``."""
    meta = json.loads((ckpt / TRAINER_META).read_text())
    stage = mcore.stage_info()
    saved = meta["layout"]
    if (saved["tensor_parallel_size"], saved["pipeline_parallel_size"]) != (stage.tp_size, stage.pp_size):
        raise CheckpointError(
            f"{ckpt}: saved at tensor_parallel_size {saved['tensor_parallel_size']} x pipeline_parallel_size "
            f"{saved['pipeline_parallel_size']}; resume with the same layout (the policy alone loads at any "
            "layout with `tlt convert`)")
    load_optimizer_state(ckpt, optimizer)
    rank = dist.get_rank()
    trainer_file = ckpt / "trainer" / f"rank{rank}.pt"
    if not trainer_file.is_file():  # resumed on more ranks than saved: rank 0's RNG, the sampler re-slices
        trainer_file = ckpt / "trainer" / "rank0.pt"
    return torch.load(trainer_file, weights_only=False)
