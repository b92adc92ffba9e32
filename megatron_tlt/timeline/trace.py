"""The rank timeline as a Chrome trace (Trace Event Format), for Perfetto (ui.perfetto.dev) and chrome://tracing.

Every span of ``timeline.jsonl`` (``timeline/spans.py``'s records: step, rank, phase, state, start, end) becomes one
complete ("X") event on its rank's track: one process (the run) holding a thread per rank, named and ordered by
metadata ("M") events. Times are whole microseconds of the wall clock, and a span's duration is the difference
of its rounded ends, so spans that meet in the records (a rank's IDLE starts where its BUSY ends) meet exactly
in the trace too, and no slice overlaps its neighbour on a track.

Standard library only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from megatron_tlt.atomic_files import write_text_atomic
from megatron_tlt.timeline.spans import BUSY, IDLE, TRAINING

TRACE_PID = 1  # one process for the run; pid/tid 0 mean the idle task to some importers (Perfetto's swapper)
# chrome://tracing's reserved colour names (Perfetto colours by name and ignores them)
STATE_COLOURS = {BUSY: "thread_state_running", IDLE: "grey", TRAINING: "yellow"}


def microseconds(seconds: float) -> int:
    return round(seconds * 1e6)


def rank_tid(rank: int) -> int:
    return rank + 1


def event_name(phase: str, state: str) -> str:
    return f"{phase} {state}"


def span_event(record: dict) -> dict:
    """One ``timeline.jsonl`` record as a complete event on its rank's track."""
    ts = microseconds(record["start"])
    return {"name": event_name(record["phase"], record["state"]), "cat": record["state"], "ph": "X",
            "ts": ts, "dur": microseconds(record["end"]) - ts, "pid": TRACE_PID, "tid": rank_tid(record["rank"]),
            "cname": STATE_COLOURS.get(record["state"], "generic_work"),
            "args": {"step": record["step"], "phase": record["phase"], "state": record["state"]}}


def track_metadata(ranks: Iterable[int], run_name: str) -> list[dict]:
    """Names the run's process and each rank's thread, and orders the threads by rank."""
    events = [{"name": "process_name", "ph": "M", "pid": TRACE_PID, "args": {"name": run_name}}]
    for rank in sorted(set(ranks)):
        events.append({"name": "thread_name", "ph": "M", "pid": TRACE_PID, "tid": rank_tid(rank),
                       "args": {"name": f"rank {rank}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": TRACE_PID, "tid": rank_tid(rank),
                       "args": {"sort_index": rank}})
    return events


def chrome_trace(records: list[dict], run_name: str = "megatron-tlt") -> dict:
    """The JSON Object Format: metadata first, then one X event per record, in the records' order."""
    events = track_metadata((r["rank"] for r in records), run_name) + [span_event(r) for r in records]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path, records: list[dict], run_name: str = "megatron-tlt") -> None:
    """Rewrite the whole trace from every record so far, atomically.

    Not the JSON Array Format appended step by step (whose closing bracket viewers let you leave off): a
    run killed mid-append would leave a file ``json.load`` and tools other than the two viewers refuse, and
    a resumed run drops the spans past its checkpoint from ``timeline.jsonl``, which an appended trace
    cannot do. Rewriting from the records under a staging name and renaming it into place leaves, at any
    moment, either the previous step's complete trace or this one's. The cost is linear in the run's spans
    (about 150 bytes each: a few MB for thousands of steps of dozens of ranks).
    """
    write_text_atomic(path, json.dumps(chrome_trace(records, run_name), separators=(",", ":")))
