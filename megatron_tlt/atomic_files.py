"""Atomic writes and keep-the-last-N, written once for every writer of the project.

A file or directory is written under a hidden staging name beside its final one and renamed into place
(``os.replace``, atomic on one file system) only once complete, so a reader, or a run resumed after a
kill, never sees a half-written one under a final name. A failure removes the staging copy and leaves
what was there before untouched.

    .NAME.partial             the staging name of a writer that owns NAME (a run's checkpoint of a step,
                              summary.json): a leftover of a killed writer is cleared by the next one
    .NAME.partial-1a2b3c4d    the staging name of writers that may race for NAME (a shared cache entry,
                              a converter's --out): each has its own

Leading dots keep staging names out of the ``step_*`` listings of ``rl/run/checkpoint_paths.py`` and
``drafter/checkpoint_paths.py``. Standard library only: the torch-free CLI paths import it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Literal

IfExists = Literal["refuse", "replace", "keep"]

_STEP = re.compile(r"step_(\d+)")


def staging_path(final: str | Path, *, unique: bool = False) -> Path:
    """The hidden name beside ``final`` that it is written under; ``unique`` for writers that may race."""
    final = Path(final)
    suffix = f"partial-{uuid.uuid4().hex[:8]}" if unique else "partial"
    return final.with_name(f".{final.name}.{suffix}")


def remove(path: str | Path) -> None:
    """Remove a file or a directory tree; nothing if it is not there."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------- files


@contextlib.contextmanager
def atomic_file(path: str | Path, *, unique: bool = False) -> Iterator[Path]:
    """Yield a staging path to write (``torch.save``, ``safetensors.save_file``, ``open``) that replaces
    ``path`` when the block succeeds; on failure it is removed and ``path`` keeps its old content."""
    path = Path(path)
    tmp = staging_path(path, unique=unique)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists() or tmp.is_symlink():
            remove(tmp)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text)


# ---------------------------------------------------------------------------------------- directories


def publish(staging: str | Path, final: str | Path, *, if_exists: IfExists = "refuse") -> Path:
    """Rename the complete directory ``staging`` to ``final``. If ``final`` exists (an empty directory is
    simply replaced): ``refuse`` raises FileExistsError, ``replace`` removes it first (a resumed run
    saving the same step again), ``keep`` keeps it and drops ``staging`` (a cache entry another process
    made first: same key, same content). ``staging`` is removed whenever it is not published."""
    staging, final = Path(staging), Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        if if_exists == "replace" and final.exists():
            remove(final)
        try:
            os.replace(staging, final)
        except OSError:
            if not (final.is_dir() and any(final.iterdir())):
                raise
            if if_exists == "keep":
                return final
            if if_exists == "refuse":
                raise FileExistsError(f"{final}: already exists and is not empty") from None
            raise
        return final
    finally:
        if staging.exists():
            remove(staging)


@contextlib.contextmanager
def atomic_dir(final: str | Path, *, if_exists: IfExists = "refuse", unique: bool = True) -> Iterator[Path]:
    """Yield a fresh staging directory beside ``final`` that becomes ``final`` when the block succeeds
    (``publish``); on failure it is removed and ``final`` is untouched.

    ``if_exists`` is ``publish``'s; ``refuse`` is also checked before the block runs, so no work is
    done for an output that could not be published. ``unique=False`` uses the fixed staging name for
    writers that own ``final`` (a leftover of a killed run is cleared first)."""
    final = Path(final)
    if if_exists == "refuse" and final.exists() and (not final.is_dir() or any(final.iterdir())):
        raise FileExistsError(f"{final}: already exists and is not empty")
    staging = staging_path(final, unique=unique)
    remove(staging)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        remove(staging)
        raise
    publish(staging, final, if_exists=if_exists)


# --------------------------------------------------------------------------------------- keep last N


def step_of(path: str | Path) -> int:
    """The step a checkpoint is named after: ``step_000010`` and ``step_000010_rank0of2.pt`` are 10."""
    match = _STEP.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path}: not named step_N")
    return int(match.group(1))


def prune_oldest(paths: Iterable[str | Path], keep: int, *, key: Callable[[Path], object] = step_of) -> list[Path]:
    """Remove all but the newest ``keep`` of ``paths`` (files or directories) by ``key`` (the step in
    their names); ``keep <= 0`` keeps all. Returns what was removed, oldest first."""
    if keep <= 0:
        return []
    ordered = sorted((Path(p) for p in paths), key=key)
    removed = ordered[:-keep]
    for old in removed:
        remove(old)
    return removed


def drop_steps_after(path: Path, last_step: int) -> None:
    """Rewrite a JSON-lines file of records with a ``step`` without those past ``last_step`` (what a run killed after
    its checkpoint wrote, dropped when it resumes from it)."""
    import json

    if path.is_file():
        kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= last_step]
        write_text_atomic(path, "".join(line + "\n" for line in kept))
