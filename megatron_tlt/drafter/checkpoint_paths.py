"""Where a run's drafter checkpoints live and which of them are complete (``drafter/checkpointer.py``
writes them).

Paths and directory listings only, free of torch: ``tlt export-drafter`` and ``tlt bench rollout``
resolve the drafter given on the command line, and refuse one that is not, before any heavy import.
"""

from __future__ import annotations

import re
from pathlib import Path

from megatron_tlt.drafter import store
from megatron_tlt.formats.hf_io import CheckpointError

DRAFTER_DIR = "drafter"
_STEP_DIR = re.compile(r"step_(\d{6})$")


def list_drafter_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete drafter checkpoints of a run as (step, directory), oldest first."""
    root = Path(run_dir) / DRAFTER_DIR
    found = []
    for path in root.glob("step_*") if root.is_dir() else []:
        match = _STEP_DIR.match(path.name)
        if match and (path / store.INFO_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def drafter_checkpoint_for(run_dir: Path, step: int) -> tuple[int, Path] | None:
    """The drafter checkpoint to resume step ``step`` with: the newest one not after it."""
    usable = [(s, p) for s, p in list_drafter_checkpoints(run_dir) if s <= step]
    return usable[-1] if usable else None


def resolve_drafter_dir(path: str | Path) -> Path:
    """An EAGLE drafter directory from itself, a run's ``drafter/step_N`` or a run (its latest drafter)."""
    path = Path(path)
    if (path / store.WEIGHTS_FILE).is_file():
        return path
    found = list_drafter_checkpoints(path)
    if not found:
        raise CheckpointError(f"{path}: neither a drafter directory ({store.WEIGHTS_FILE}) nor a run with "
                              "drafter checkpoints (drafter/step_N)")
    return found[-1][1]
