"""How much work on one core slows another core on this machine (why the spot trainer costs more on CPU).

    python bench/cpu_contention.py

Times a compute-bound loop (256x256 matmuls) and a memory-bound loop (in-place scaling of a 32 MB
tensor) pinned to the last core, alone and then beside a compute-bound or memory-bound load pinned to
core 0, and prints each ratio. One thread per process, as the RL ranks run. Linux only (CPU affinity).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time


def _kernel(kind: str, seconds: float | None = None, repeats: int = 1):
    import torch

    torch.set_num_threads(1)
    if kind == "compute":
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        step = lambda: [a @ b for _ in range(50)]  # noqa: E731
    else:
        x = torch.randn(8_000_000)
        step = lambda: x.mul_(1.0001)  # noqa: E731
    if seconds is not None:  # the load: run until told time is up
        end = time.time() + seconds
        while time.time() < end:
            step()
        return None
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(20):
            step()
        best = min(best, time.perf_counter() - start)
    return best


def _load(kind: str, seconds: float) -> None:
    os.sched_setaffinity(0, {0})
    _kernel(kind, seconds=seconds)


def main() -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores")
    os.sched_setaffinity(0, {cores[-1]})
    alone = {kind: _kernel(kind, repeats=5) for kind in ("compute", "memory")}
    for load in ("compute", "memory"):
        process = mp.get_context("spawn").Process(target=_load, args=(load, 30.0))
        process.start()
        time.sleep(3.0)  # let the load start
        beside = {kind: _kernel(kind, repeats=5) for kind in ("compute", "memory")}
        process.terminate()
        process.join()
        for kind in ("compute", "memory"):
            print(f"{kind:7s} loop on core {cores[-1]} beside a {load:7s} load on core 0: "
                  f"{beside[kind] / alone[kind]:.3f}x its time alone", flush=True)


if __name__ == "__main__":
    main()
