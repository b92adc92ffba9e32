"""Start a function on N local ranks with torch's own elastic launcher (what torchrun uses).

Commands such as ``tlt convert --tp 2`` need a world of tp x pp processes. Under torchrun with the
right world size the function simply runs in place; otherwise ``elastic_launch`` spawns the ranks
on this node. Each rank gets an equal share of the cores so ranks do not oversubscribe them.

On a machine without CUDA the ranks fork from a server process that imported the heavy stack once
(torch, Megatron-Core, vLLM): a spawned rank spends ~8-10 s importing it and ~3 s tearing it down
after it returns, and a process that launches ranks many times (the test suite, a benchmark) paid
that on every launch. Machines with CUDA keep spawn: a forked rank must never share CUDA state, and
there torchrun starts the ranks once per job anyway.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from typing import Any

from megatron_tlt.rank_logs import RankLogSettings, RankOutput, launch_records_to_file, log_path


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


# What the fork server imports once for every rank it will fork; preload_in_ranks() adds to it.
# preload_logging first: it holds what the imports after it log for the ranks' logs (rank_logs.py).
_FORKSERVER_PRELOAD = ["megatron_tlt.preload_logging", "megatron_tlt.launcher", "megatron.core"]

ENGINE_IMPORTS = ("vllm.entrypoints.llm",)
"""What ``from vllm import LLM`` imports (~7 s): preloaded by whatever launches ranks that run engines."""


def preload_in_ranks(*modules: str) -> None:
    """Have the ranks this process launches start with ``modules`` imported (CPU: by the fork server).

    The fork server imports what was asked for by the time of the first launch, and later launches
    share it: a process that launches ranks many times asks for everything its ranks use up front.
    """
    _FORKSERVER_PRELOAD.extend(m for m in modules if m not in _FORKSERVER_PRELOAD)


# Set for each rank by torch's elastic agent (torch/distributed/elastic/agent/server/local_elastic_agent.py);
# everything else in a rank's environment is the launching process's at the time of the launch.
_PER_RANK_VARIABLES = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
})


def _start_method() -> str:
    import multiprocessing

    from megatron_tlt import cpu_compat

    if cpu_compat.cuda_available():
        return "spawn"
    # No effect once the server runs: it keeps what it imported at its start.
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(_FORKSERVER_PRELOAD))
    return "forkserver"


def _set_per_rank(key: str) -> bool:
    return key in _PER_RANK_VARIABLES or key.startswith("TORCHELASTIC_")


def _launch_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not _set_per_rank(k)}


def _adopt_environment(environment: dict[str, str]) -> None:
    """A forked rank starts with the environment its fork server had when it started: make it the
    launching process's of now (a test may have set a variable since), keeping the agent's own."""
    for key in [k for k in os.environ if k not in environment and not _set_per_rank(k)]:
        del os.environ[key]
    os.environ.update(environment)


def _threads_per_rank(nprocs: int) -> int:
    return max(1, (os.cpu_count() or 1) // nprocs)


def _pin_to_own_cores(threads: int, local: int | None = None, ranks: int | None = None) -> None:
    """On CPU, keep this rank on cores of its own (local rank r: the r-th ``threads`` of the allowed ones), with
    every thread it starts from here on (they inherit the affinity). Unpinned, the OS moves the ranks' threads
    (theirs, gloo's) across the cores: drafter training on an idle rank slowed another rank's rollout by ~10%
    (bench/RESULTS.md). Where the ranks outnumber the cores the OS keeps deciding."""
    from megatron_tlt import cpu_compat

    if cpu_compat.cuda_available() or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    local = int(os.environ.get("LOCAL_RANK", 0)) if local is None else local
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if ranks is None else ranks
    if ranks < 2 or ranks * threads > len(cores):
        return
    os.sched_setaffinity(0, cores[local * threads:(local + 1) * threads])


def run_like_rank_zero_of(nprocs: int) -> None:
    """Give this process the threads and cores that local rank 0 of an ``nprocs``-rank launch gets: a benchmark
    of one engine then measures it as a rank of that run drives it (on 2 cores, one core and one thread each;
    with both cores, the plain engine's matmuls spread over them and speculation's serial draft passes do not)."""
    _take_cores(_threads_per_rank(nprocs), local=0, ranks=nprocs)


def _take_cores(threads: int, local: int | None = None, ranks: int | None = None) -> None:
    """Run torch on ``threads`` threads, pinned to this rank's share of the cores (``_pin_to_own_cores``)."""
    import torch

    torch.set_num_threads(threads)
    _pin_to_own_cores(threads, local, ranks)


class RankStopped(SystemExit):
    """SIGTERM reached a rank: torch's agent stops the other ranks so when one fails (or the job is cancelled)."""


def _exit_on_sigterm() -> None:
    """SIGTERM's default action ends a process at once: no ``finally``, no atexit. The multiprocessing Manager that
    Megatron's checkpoint save starts then outlives its rank, and holds the launcher's stdout and stderr open (a
    caller reading them waits forever). As an exception, the rank unwinds and its children are shut down with it
    (a rank blocked in a collective unwinds when the call returns, or the agent's SIGKILL comes)."""
    import signal

    def stop(signum, frame):
        raise RankStopped("stopped by SIGTERM: another rank failed, or the job was cancelled")

    signal.signal(signal.SIGTERM, stop)


def _run_rank(fn: Callable, threads: int, logs: RankLogSettings, environment: dict[str, str], args: tuple) -> Any:
    import gc

    _exit_on_sigterm()

    # What the fork server imported lives as long as the rank: out of the collector's way, vLLM's
    # gc.collect() calls while an engine starts and stops take ~0.1 s instead of ~0.6 s each.
    gc.freeze()
    _adopt_environment(environment)
    _take_cores(threads)
    # Spawned and forked ranks start with logging unconfigured: the launcher's level (`tlt -v`), its log directory.
    output = RankOutput(logs, launched_rank())
    output.start()  # never stopped: what the rank prints until it exits belongs to its log
    try:
        return fn(*args)
    except BaseException:
        output.log_failure()
        raise


def launched_world_size() -> int | None:
    """The world size torchrun started us with, or None outside torchrun."""
    return int(os.environ["WORLD_SIZE"]) if "TORCHELASTIC_RUN_ID" in os.environ else None


def launched_rank() -> int:
    """This process's global rank as torchrun set it (0 outside torchrun)."""
    return int(os.environ.get("RANK", "0"))


def _failure_message(message: str, logs: RankLogSettings, rank: int) -> str:
    message = message.strip().splitlines()[-1] if message.strip() else "failed"
    return message if logs.directory is None else f"{message} (rank {rank}; full log: {log_path(logs.directory, rank)})"


def _run_in_place(fn: Callable, logs: RankLogSettings, args: tuple) -> dict[int, Any]:
    if launched_world_size() is not None:  # a rank of an outside torchrun: its agent stops ranks as ours does
        _exit_on_sigterm()
    if logs.directory is None:
        return {launched_rank(): fn(*args)}
    output = RankOutput(logs, launched_rank())
    output.start()
    try:
        return {launched_rank(): fn(*args)}
    except Exception as err:
        output.log_failure()
        raise WorkerFailed(_failure_message(f"{type(err).__name__}: {err}", logs, launched_rank())) from None
    finally:
        output.stop()


def run_on_ranks(fn: Callable, nprocs: int, *args: Any, isolated: bool = False,
                 log_dir: str | None = None) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nprocs`` local ranks; returns {rank: return value}.

    ``fn`` must be importable (a module-level function): ranks are fresh processes, spawned or forked
    from the clean fork server, never from this one. A single rank runs in this process unless
    ``isolated`` (e.g. to keep an engine's global state out of it). With ``log_dir`` each rank writes
    its full output to ``log_dir/rank{N}.log`` and the console keeps rank 0's progress and every error
    (``rank_logs.py``; ``tlt -v`` keeps the full console too); a rank's failure names its log.
    """
    logs = RankLogSettings(directory=log_dir, level=logging.getLogger().getEffectiveLevel())
    if (nprocs == 1 and not isolated) or launched_world_size() == nprocs:
        return _run_in_place(fn, logs, args)
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
        start_method=_start_method(),
    )
    try:
        # With rank logs, the console shows the failed rank's error once, from WorkerFailed: what the agent
        # logs about it (its traceback, the ranks it terminates) goes to the log directory.
        with launch_records_to_file(logs):
            return elastic_launch(config, _run_rank)(fn, _threads_per_rank(nprocs), logs, _launch_environment(), args)
    except ChildFailedError as err:
        rank, first = err.get_first_failure()
        message = first.message.get("message") if isinstance(first.message, dict) else first.message
        raise WorkerFailed(_failure_message(str(message or err), logs, rank)) from None
