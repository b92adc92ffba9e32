"""vLLM's static per-batch-size depth table, written from a sweep of fixed depths (``bench/depth_table.py``)."""

import pytest
from script_modules import load_script

depth_table = load_script("bench/depth_table.py", "depth_table")
DepthSweepRun, table_from_sweep = depth_table.DepthSweepRun, depth_table.table_from_sweep
bucket_ranges, format_table, parse_table = depth_table.bucket_ranges, depth_table.format_table, depth_table.parse_table

BOUNDS = [1, 2, 5, 21, 32]  # TLT's buckets: 1, 2, 3-5, 6-21, 22-32, 33+


def test_bucket_ranges_cover_every_batch_size_up_to_the_engines_widest():
    assert bucket_ranges(BOUNDS, 64) == [(1, 1), (2, 2), (3, 5), (6, 21), (22, 32), (33, 64)]
    assert bucket_ranges(BOUNDS, 16) == [(1, 1), (2, 2), (3, 5), (6, 16)]


def _run(steps: list[tuple[int, float]], tokens_per_sequence_step: float) -> DepthSweepRun:
    return DepthSweepRun([b for b, _ in steps], [s for _, s in steps], tokens_per_sequence_step)


def test_each_bucket_takes_the_depth_that_made_tokens_fastest_there():
    """Depth 4 makes 3.5 tokens per sequence-step at 4x the step cost at batch 64 and 1.2x at batch 8."""
    plain = _run([(64, 1.0), (8, 1.0)], 1.0)  # 64 and 8 tokens per second
    deep = _run([(64, 4.0), (8, 1.2)], 3.5)  # 56 and 23.3 tokens per second
    table = table_from_sweep({0: plain, 4: deep}, BOUNDS, 64)
    # batch 8 (6-21) goes to depth 4, batch 64 (33+) to depth 0; 22-32, which no run reached, follows the bucket
    # before it, and 1-5 takes the best depth over all batch sizes (4: 252 tokens in 5.2 s, against 72 in 2 s)
    assert table == [(1, 32, 4), (33, 64, 0)]


def test_a_sweep_that_reached_no_bucket_of_a_range_and_bad_input():
    only_wide = _run([(40, 1.0)], 1.0)
    assert table_from_sweep({0: only_wide, 2: _run([(40, 0.5)], 2.0)}, BOUNDS, 64) == [(1, 64, 2)]
    with pytest.raises(ValueError, match="at least one"):
        table_from_sweep({}, BOUNDS, 64)


def test_tables_are_written_and_read_back_as_the_command_line_takes_them():
    table = [(1, 21, 4), (22, 32, 3), (33, 256, 0)]
    assert format_table(table) == "1-21:4, 22-32:3, 33-256:0"
    assert parse_table(format_table(table)) == table
    for bad in ("1-8", "2-8:4", "1-8:4,10-20:2", "1-8:4,5-20:2", "1-8:-1", "a-b:c", "1-0:2"):
        with pytest.raises(ValueError):
            parse_table(bad)
