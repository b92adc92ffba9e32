"""Start a function on N local ranks with torch's own elastic launcher (what torchrun uses).

Commands such as ``tlt convert --tp 2`` need a world of tp x pp processes. Under torchrun with the
right world size the function simply runs in place; otherwise ``elastic_launch`` spawns the ranks
on this node. Each rank gets an equal share of the cores so ranks do not oversubscribe them.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from typing import Any


class WorkerFailed(RuntimeError):
    """A launched rank raised; the message is the root cause reported by that rank."""


# Harmless notices printed by every process that imports Megatron-Core or loads a dist checkpoint:
# optional fused kernels we do not use, and deprecations inside torch.distributed.checkpoint.
# Literal message prefixes (no regex characters, commas or colons), valid in PYTHONWARNINGS too.
_KNOWN_DEPENDENCY_WARNINGS = (
    "Apex is not installed",
    "Transformer Engine and Apex are not installed",
    "full scope is deprecated",
    "`load_state_dict` is deprecated",
    "Please use DTensor instead",
    "`torch.distributed.all_gather_into_tensor` is deprecated",
    "When using async grad allreduce it is recommended",  # CUDA-only tuning advice
)


def silence_known_dependency_warnings() -> None:
    """Filter them in this process and, through PYTHONWARNINGS, in the ranks it spawns."""
    import warnings

    for prefix in _KNOWN_DEPENDENCY_WARNINGS:
        warnings.filterwarnings("ignore", message=prefix)
    # Spawned interpreters import Megatron while unpickling their target, before any code of ours
    # runs; the environment is the only filter in place by then.
    filters = [f"ignore:{prefix}" for prefix in _KNOWN_DEPENDENCY_WARNINGS]
    existing = os.environ.get("PYTHONWARNINGS")
    if existing is None or filters[0] not in existing:
        os.environ["PYTHONWARNINGS"] = ",".join(([existing] if existing else []) + filters)


def _threads_per_rank(nprocs: int) -> int:
    return max(1, (os.cpu_count() or 1) // nprocs)


def _run_rank(fn: Callable, threads: int, log_level: int, args: tuple) -> Any:
    import torch

    torch.set_num_threads(threads)
    # Spawned interpreters start with logging unconfigured: give them the launcher's level (`tlt -v`).
    logging.basicConfig(level=log_level, format=f"%(asctime)s [rank{os.environ.get('RANK', '?')}] %(name)s: %(message)s")
    return fn(*args)


def launched_world_size() -> int | None:
    """The world size torchrun started us with, or None outside torchrun."""
    return int(os.environ["WORLD_SIZE"]) if "TORCHELASTIC_RUN_ID" in os.environ else None


def launched_rank() -> int:
    """This process's global rank as torchrun set it (0 outside torchrun)."""
    return int(os.environ.get("RANK", "0"))


def run_on_ranks(fn: Callable, nprocs: int, *args: Any, isolated: bool = False) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nprocs`` local ranks; returns {rank: return value}.

    ``fn`` must be importable (a module-level function): ranks are spawned, not forked. A single
    rank runs in this process unless ``isolated`` (e.g. to keep an engine's global state out of it).
    """
    if (nprocs == 1 and not isolated) or launched_world_size() == nprocs:
        return {launched_rank(): fn(*args)}
    # deferred: torch takes ~1.9 s to import, and every tlt command imports this module before it validates
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    silence_known_dependency_warnings()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # as torchrun --standalone: the OS picks a free port, no race
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        return elastic_launch(config, _run_rank)(fn, _threads_per_rank(nprocs),
                                                 logging.getLogger().getEffectiveLevel(), args)
    except ChildFailedError as err:
        _, first = err.get_first_failure()
        message = first.message.get("message") if isinstance(first.message, dict) else first.message
        raise WorkerFailed(str(message or err).strip().splitlines()[-1]) from None
