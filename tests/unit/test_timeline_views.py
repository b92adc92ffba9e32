"""The rank timeline as people look at it: a Chrome trace of every span and a PNG of the last step."""

from __future__ import annotations

import json

import pytest

from megatron_tlt.rl.run import run_dir as run_files
from megatron_tlt.rl.run.metric_loggers import MetricLoggers
from megatron_tlt.timeline.plot import STATE_COLOURS, plot_step_timeline
from megatron_tlt.timeline.spans import BUSY, IDLE, TRAINING, RankTimeline

T0 = 1_795_000_000.123456  # a wall-clock time of 2026, at time.time()'s resolution


def synthetic_step(step: int, start: float, ranks: int = 3) -> list[dict]:
    """One step as the trainer records it: rollout BUSY then IDLE until the slowest rank (rank 0 spends part
    of its idle time TRAINING the drafter), then the collective phases, all ranks in step."""
    records = []
    slowest = 1.0 + 0.25 * (ranks - 1)
    for rank in range(ranks):
        timeline, t = RankTimeline(rank), start
        busy_end = t + 1.0 + 0.25 * rank
        timeline.add("rollout", BUSY, t, busy_end)
        if rank == 0:
            timeline.add("rollout", IDLE, busy_end, busy_end + 0.05)
            timeline.add("rollout", TRAINING, busy_end + 0.05, busy_end + 0.3)
            timeline.add("rollout", IDLE, busy_end + 0.3, start + slowest)
        elif rank < ranks - 1:
            timeline.add("rollout", IDLE, busy_end, start + slowest)
        t = start + slowest
        for phase, seconds in (("reward", 0.01), ("logprob", 0.2), ("update", 0.4), ("sync", 0.1)):
            timeline.add(phase, BUSY, t, t + seconds)
            t += seconds
        records += timeline.to_records(step)
    return records


def synthetic_run(steps: int, ranks: int = 3) -> list[list[dict]]:
    return [synthetic_step(step, T0 + 3.0 * (step - 1), ranks) for step in range(1, steps + 1)]


def assert_trace_holds_exactly(trace: dict, spans: list[dict]) -> None:
    """Each span is one X event on its rank's track with its name, step and times in whole microseconds,
    and the trace holds nothing else but the tracks' names."""
    events = trace["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(threads.values()) == [f"rank {r}" for r in sorted({s["rank"] for s in spans})]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(spans) and len(events) == len(complete) + 1 + 2 * len(threads)
    for span, event in zip(spans, complete):
        assert event["name"] == f"{span['phase']} {span['state']}" and event["cat"] == span["state"]
        assert threads[event["tid"]] == f"rank {span['rank']}" and event["pid"] == 1
        assert event["ts"] == round(span["start"] * 1e6)
        assert event["dur"] == round(span["end"] * 1e6) - round(span["start"] * 1e6)
        assert event["args"] == {"step": span["step"], "phase": span["phase"], "state": span["state"]}


def _reporter(run_dir, start_step=0, records=None):
    return run_files.RunReporter(run_dir, total_steps=4, start_step=start_step, records=records or [],
                                 loggers=MetricLoggers([]))


def _record(step: int) -> dict:
    return {"step": step, "reward_mean": 0.5, "accuracy": 0.25, "response_length_mean": 30.0,
            "rollout_idle_share_mean": 0.2}


def test_every_step_leaves_a_trace_that_parses_and_holds_every_span_of_timeline_jsonl(tmp_path):
    reporter = _reporter(tmp_path)
    for step, spans in enumerate(synthetic_run(3), start=1):
        reporter.log_step(_record(step), spans)
        trace = json.loads((tmp_path / run_files.TRACE_FILE).read_text())
        assert_trace_holds_exactly(trace, run_files.read_timeline(tmp_path))
    reporter.close()
    assert len(run_files.read_timeline(tmp_path)) == 3 * (8 + 6 + 5)  # per step: rank 0 trains, rank 2 is slowest
    assert not list(tmp_path.glob(".*"))  # no staging file left behind


def test_views_left_for_a_checkpoint_are_brought_up_to_date_by_the_next_one_or_by_close(tmp_path):
    """The trainer refreshes the trace and PNG at checkpoints only (rank 0 draws while the others wait)."""
    reporter = _reporter(tmp_path)
    run = synthetic_run(3, ranks=2)
    reporter.log_step(_record(1), run[0], refresh_views=True)
    reporter.log_step(_record(2), run[1], refresh_views=False)
    trace = json.loads((tmp_path / run_files.TRACE_FILE).read_text())
    assert {e["args"]["step"] for e in trace["traceEvents"] if e["ph"] == "X"} == {1}  # step 2 not drawn yet
    assert len(run_files.read_timeline(tmp_path)) == len(run[0]) + len(run[1])  # but on disk in timeline.jsonl
    reporter.log_step(_record(3), run[2], refresh_views=False)
    reporter.close()
    assert_trace_holds_exactly(json.loads((tmp_path / run_files.TRACE_FILE).read_text()),
                               run_files.read_timeline(tmp_path))
    from matplotlib.image import imread

    plot_step_timeline(run[-1], tmp_path / "alone.png")
    assert (imread(tmp_path / "alone.png") == imread(tmp_path / run_files.TIMELINE_PLOT_FILE)).all()


def test_spans_that_meet_in_the_records_meet_in_the_trace_and_never_overlap_on_a_track():
    from megatron_tlt.timeline.trace import chrome_trace

    spans = [s for step in synthetic_run(2) for s in step]
    events = [e for e in chrome_trace(spans)["traceEvents"] if e["ph"] == "X"]
    for tid in {e["tid"] for e in events}:
        track = sorted((e for e in events if e["tid"] == tid), key=lambda e: e["ts"])
        assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(track, track[1:]))
        # within a step the spans tile the track: each starts where the one before it ends
        for a, b in zip(track, track[1:]):
            if a["args"]["step"] == b["args"]["step"]:
                assert a["ts"] + a["dur"] == b["ts"]


def test_a_resumed_run_rewrites_the_trace_without_the_steps_past_its_checkpoint(tmp_path):
    reporter = _reporter(tmp_path)
    for step, spans in enumerate(synthetic_run(3), start=1):
        reporter.log_step(_record(step), spans)
    run_files.truncate_timeline(tmp_path, 2)  # as the trainer does when resuming from step 2
    _reporter(tmp_path, start_step=2, records=[_record(1), _record(2)])
    trace = json.loads((tmp_path / run_files.TRACE_FILE).read_text())
    assert {e["args"]["step"] for e in trace["traceEvents"] if e["ph"] == "X"} == {1, 2}
    assert_trace_holds_exactly(trace, run_files.read_timeline(tmp_path))


LEGEND_ROWS = 30  # the title and the legend's colour patches are above the bars, in the image's top rows


def _in_colour(image, colour: str):
    """Which pixels below the legend are drawn in ``colour``."""
    from matplotlib.colors import to_rgb

    return abs(image[LEGEND_ROWS:, :, :3] - to_rgb(colour)).max(axis=-1) < 0.02


def _pixels_of(image, colour: str) -> int:
    return int(_in_colour(image, colour).sum())


def test_the_png_draws_the_last_step_a_row_per_rank_coloured_by_state(tmp_path):
    from matplotlib.image import imread

    reporter = _reporter(tmp_path)
    run = synthetic_run(2, ranks=2)
    for step, spans in enumerate(run, start=1):
        reporter.log_step(_record(step), spans)
    image = imread(tmp_path / run_files.TIMELINE_PLOT_FILE)
    assert 150 < image.shape[0] < 600 and 400 < image.shape[1] < 1000  # small
    for state in (BUSY, IDLE, TRAINING):
        assert _pixels_of(image, STATE_COLOURS[state]) > 100, state

    # the same picture as plotting the last step alone: step 1 is not in it
    plot_step_timeline(run[-1], tmp_path / "alone.png")
    assert (imread(tmp_path / "alone.png") == image).all()


def test_a_step_without_training_spans_has_no_training_colour(tmp_path):
    from matplotlib.image import imread

    spans = [s for s in synthetic_step(1, T0, ranks=2) if s["state"] != TRAINING]
    plot_step_timeline(spans, tmp_path / "t.png")
    image = imread(tmp_path / "t.png")
    assert _pixels_of(image, STATE_COLOURS[TRAINING]) == 0 < _pixels_of(image, STATE_COLOURS[IDLE])


@pytest.mark.parametrize("ranks", [1, 8])
def test_the_png_has_a_row_per_rank(tmp_path, ranks):
    from matplotlib.image import imread

    plot_step_timeline(synthetic_step(1, T0, ranks=ranks), tmp_path / "t.png")
    rows = _in_colour(imread(tmp_path / "t.png"), STATE_COLOURS[BUSY]).any(axis=1)
    bands = int(rows[0]) + int((rows[1:] & ~rows[:-1]).sum())  # separate runs of pixel rows holding bars
    assert bands == ranks
