"""Drafter checkpoints of an RL run, written asynchronously and atomically, and read back on resume.

    run_dir/drafter/step_000010/             the (averaged) drafter after step 10: a servable EAGLE dir
    run_dir/drafter/adam/step_000010_rank0of2.pt   each rank's own Adam moments (not averaged)

Saving costs the critical path nothing but handing the tensors to a background thread, which writes them
(rank 0 the weights, every rank its Adam file) while the log-prob, update and sync phases run. No copy is
taken: the drafter only changes in the next rollout's idle time, and the spot trainer does not train
while a write is in flight (``writing()``). Weights go to a staging directory that is renamed when
complete, an Adam file to a staging name that is renamed (``atomic_files``), so a run killed mid-write
leaves no partial checkpoint under a final name. A save first waits for the previous write. A failed
write is logged and the run goes on (the previous checkpoint stays).

Not saved: the feature buffer. A resumed run trains the drafter again from its next log-prob pass.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from pathlib import Path

import torch

from megatron_tlt import atomic_files
from megatron_tlt.drafter import store
from megatron_tlt.drafter.checkpoint_paths import DRAFTER_DIR, list_drafter_checkpoints
from megatron_tlt.formats.architecture import PolicyArchitecture

logger = logging.getLogger(__name__)

ADAM_SUBDIR = "adam"


def _step_name(step: int) -> str:
    return f"step_{step:06d}"


def _adam_file(run_dir: Path, step: int, rank: int, world: int) -> Path:
    return run_dir / DRAFTER_DIR / ADAM_SUBDIR / f"{_step_name(step)}_rank{rank}of{world}.pt"


def _to_cpu(value):
    """Every tensor of a (nested) optimizer state on the CPU (no copy for CPU tensors)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


class AsyncDrafterCheckpointer:
    def __init__(self, run_dir: Path, arch: PolicyArchitecture, *, rank: int, world: int, keep: int):
        self.run_dir, self.arch = Path(run_dir), arch
        self.rank, self.world, self.keep = rank, world, keep
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="drafter-ckpt")
        self._pending: concurrent.futures.Future | None = None
        self.last_handoff_seconds = 0.0
        self.last_write_seconds = 0.0

    def save(self, step: int, drafter, optimizer: torch.optim.Optimizer, info: dict) -> None:
        """Write in the background. ``drafter`` must already be the averaged version, and neither it nor
        ``optimizer`` may change until ``writing()`` is False."""
        start = time.perf_counter()
        self.wait()
        state = optimizer.state_dict()  # references to the live moments, not copies
        self._pending = self._writer.submit(self._write, step, drafter if self.rank == 0 else None, state,
                                            dict(info, step=step))
        self.last_handoff_seconds = time.perf_counter() - start

    def writing(self) -> bool:
        """Whether a write is still reading the drafter and its optimizer state."""
        return self._pending is not None and not self._pending.done()

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def close(self) -> None:
        self.wait()
        self._writer.shutdown(wait=True)

    # ------------------------------------------------------------------ the background thread

    def _write(self, step: int, drafter, adam: dict, info: dict) -> None:
        start = time.perf_counter()
        try:
            adam = _to_cpu(adam)
            tensors = drafter.export_tensors() if drafter is not None else None
            adam_path = _adam_file(self.run_dir, step, self.rank, self.world)
            adam_path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_files.atomic_file(adam_path) as partial:
                torch.save(adam, partial)
            if tensors is not None:
                self._write_weights(step, tensors, info)
            self._prune()
            self.last_write_seconds = time.perf_counter() - start
            logger.info("drafter checkpoint of step %d written in %.3f s in the background (%.1f ms on the "
                        "critical path)", step, self.last_write_seconds, 1000 * self.last_handoff_seconds)
        except Exception:
            logger.exception("drafter checkpoint of step %d was not written (the run goes on; the previous "
                             "drafter checkpoint is kept)", step)

    def _write_weights(self, step: int, tensors: dict, info: dict) -> None:
        final = self.run_dir / DRAFTER_DIR / _step_name(step)
        # Replace: a resumed run saving the same step again. Fixed staging name: a killed write's is cleared.
        with atomic_files.atomic_dir(final, if_exists="replace", unique=False) as staging:
            store.write_drafter_files(staging, self.arch, tensors, info)

    def _prune(self) -> None:
        mine = (self.run_dir / DRAFTER_DIR / ADAM_SUBDIR).glob(f"step_*_rank{self.rank}of{self.world}.pt")
        atomic_files.prune_oldest(mine, self.keep)
        if self.rank == 0:
            atomic_files.prune_oldest((path for _, path in list_drafter_checkpoints(self.run_dir)), self.keep)


def load_adam_state(run_dir: Path, step: int, optimizer: torch.optim.Optimizer, *, rank: int, world: int) -> bool:
    """This rank's Adam moments saved with the drafter of ``step``; False (fresh Adam) if there are none."""
    path = _adam_file(Path(run_dir), step, rank, world)
    if not path.is_file():
        return False
    optimizer.load_state_dict(torch.load(path, weights_only=False))
    return True
