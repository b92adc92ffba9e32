"""`launcher.run_on_ranks`: ranks are fresh processes that see the launching process as it is at the launch.

On CPU the ranks fork from a server started at the first launch, which keeps the environment of that
moment; each launch hands its own environment over.
"""

import os

import pytest

from megatron_tlt.launcher import run_on_ranks


def _environment_of_rank(names: tuple[str, ...]) -> dict:
    return {"pid": os.getpid(), "rank": os.environ["RANK"], **{name: os.environ.get(name) for name in names}}


def test_each_launch_hands_its_environment_to_fresh_ranks(monkeypatch):
    names = ("TLT_TEST_LAUNCH", "TLT_TEST_DROPPED")
    monkeypatch.setenv("TLT_TEST_LAUNCH", "first")
    monkeypatch.setenv("TLT_TEST_DROPPED", "set")
    first = run_on_ranks(_environment_of_rank, 2, names)
    monkeypatch.setenv("TLT_TEST_LAUNCH", "second")
    monkeypatch.delenv("TLT_TEST_DROPPED")
    second = run_on_ranks(_environment_of_rank, 2, names)

    assert [first[r]["rank"] for r in (0, 1)] == [second[r]["rank"] for r in (0, 1)] == ["0", "1"]
    assert all(first[r]["TLT_TEST_LAUNCH"] == "first" and first[r]["TLT_TEST_DROPPED"] == "set" for r in (0, 1))
    assert all(second[r]["TLT_TEST_LAUNCH"] == "second" and second[r]["TLT_TEST_DROPPED"] is None for r in (0, 1))
    pids = {result["pid"] for result in (*first.values(), *second.values())}
    assert len(pids) == 4 and os.getpid() not in pids  # four fresh processes, none of them this one


def _cores_of_rank_and_its_threads() -> dict:
    import threading

    seen = {}
    thread = threading.Thread(target=lambda: seen.update(thread=os.sched_getaffinity(0)))
    thread.start()
    thread.join()
    return {"rank": sorted(os.sched_getaffinity(0)), "new_thread": sorted(seen["thread"])}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to give each of 2 ranks its own")
def test_cpu_ranks_are_pinned_to_cores_of_their_own_with_the_threads_they_start():
    cores = sorted(os.sched_getaffinity(0))
    got = run_on_ranks(_cores_of_rank_and_its_threads, 2)
    share = len(cores) // 2
    for rank in (0, 1):
        assert got[rank]["rank"] == got[rank]["new_thread"] == cores[rank * share:(rank + 1) * share], got


def _cores_and_threads_like_rank_zero_of(nprocs: int) -> dict:
    import torch

    from megatron_tlt.launcher import run_like_rank_zero_of

    run_like_rank_zero_of(nprocs)
    return {"cores": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads()}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to give each of 2 ranks its own")
def test_a_one_rank_benchmark_gets_the_cores_and_threads_of_rank_zero_of_the_run_it_stands_for():
    """`tlt bench rollout` runs one engine as a rank of the config's 2-rank run drives it, not on every core."""
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // 2
    got = run_on_ranks(_cores_and_threads_like_rank_zero_of, 1, 2, isolated=True)[0]
    assert got == {"cores": cores[:share], "threads": share}
    alone = run_on_ranks(_cores_and_threads_like_rank_zero_of, 1, 1, isolated=True)[0]  # a 1-rank run: every core
    assert alone == {"cores": cores, "threads": len(cores)}
