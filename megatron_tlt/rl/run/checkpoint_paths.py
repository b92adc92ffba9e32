"""Where a run's RL checkpoints live and which of them are complete (``rl/run/checkpoint.py`` writes and loads them).

Paths and directory listings only, free of torch and Megatron: ``tlt`` resolves a run or checkpoint
given on the command line, and refuses one that is not, before it starts any rank.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_tlt.atomic_files import step_of
from megatron_tlt.formats.hf_io import CheckpointError
from megatron_tlt.formats.policy_meta import META_FILE

CHECKPOINTS_DIR = "checkpoints"
POLICY_SUBDIR = "policy"
OPTIMIZER_SUBDIR = "optimizer"
TRAINER_META = "trainer.json"


def step_dir(run_dir: Path, step: int) -> Path:
    """Where a run's checkpoint of ``step`` lives (complete or not)."""
    return run_dir / CHECKPOINTS_DIR / f"step_{step:06d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = run_dir / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    complete = [p for p in root.glob("step_*") if (p / TRAINER_META).is_file()]
    return sorted(complete, key=step_of)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def checkpoint_step(ckpt: Path) -> int:
    return int(json.loads((ckpt / TRAINER_META).read_text())["step"])


def resolve_policy_dir(path: str | Path) -> Path:
    """A policy checkpoint directory from a run directory (its latest checkpoint), a checkpoint
    (``checkpoints/step_N``) or a policy checkpoint itself."""
    path = Path(path)
    if (path / META_FILE).is_file():
        return path
    if (path / TRAINER_META).is_file():
        return path / POLICY_SUBDIR
    latest = latest_checkpoint(path)
    if latest is not None:
        return latest / POLICY_SUBDIR
    raise CheckpointError(f"{path}: not a megatron-tlt checkpoint: not a run directory, a checkpoint or a policy "
                          f"checkpoint ({META_FILE} missing)")
