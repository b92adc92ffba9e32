"""A small PNG of one step's rank timeline: a row per rank, a bar per span coloured by its state, phase labels.

Drawn with matplotlib's Agg canvas on a ``Figure`` of its own (no pyplot): no display, no global figure
state, nothing that changes the backend for the rest of the process.
"""

from __future__ import annotations

from pathlib import Path

from megatron_tlt.atomic_files import atomic_file
from megatron_tlt.timeline.spans import BUSY, IDLE, TRAINING

STATE_COLOURS = {BUSY: "#4C72B0", IDLE: "#D0D0D0", TRAINING: "#DD8452"}
OTHER_STATE_COLOUR = "#8C8C8C"
LABEL_MIN_WIDTH = 0.06  # a phase label is written into spans at least this share of the step wide
LABEL_MIN_ROW_INCHES = 0.2  # ... in rows at least this tall
MAX_ROWS_INCHES = 10.0  # the rows' height with many ranks
MAX_RANK_LABELS = 32  # more ranks than this: every k-th is named


def plot_step_timeline(records: list[dict], path: str | Path) -> None:
    """Write ``path`` (PNG) from one step's ``timeline.jsonl`` records; seconds from the step's first span."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    ranks = sorted({r["rank"] for r in records})
    origin = min(r["start"] for r in records)
    width = max(max(r["end"] for r in records) - origin, 1e-9)
    row_inches = min(0.5, MAX_ROWS_INCHES / len(ranks))  # many ranks: thinner rows, the same small picture
    height = row_inches * len(ranks) + 1.0  # inches: the rows, the title and legend above, the x axis below
    figure = Figure(figsize=(7, height), dpi=100)
    # fixed margins (not bbox_inches="tight", which draws the figure twice)
    figure.subplots_adjust(left=0.1, right=0.98, top=1 - 0.35 / height, bottom=0.55 / height)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    row = {rank: i for i, rank in enumerate(ranks)}
    ys = [row[r["rank"]] for r in records]
    lefts = [r["start"] - origin for r in records]
    spans = [r["end"] - r["start"] for r in records]
    # one collection of rectangles, drawn in one call however many ranks (a bar artist each is ~100x slower)
    axes.add_collection(PolyCollection(
        [[(x, y - 0.35), (x + w, y - 0.35), (x + w, y + 0.35), (x, y + 0.35)] for x, y, w in zip(lefts, ys, spans)],
        facecolors=[STATE_COLOURS.get(r["state"], OTHER_STATE_COLOUR) for r in records],
        edgecolors="white", linewidths=0.5 if row_inches >= LABEL_MIN_ROW_INCHES else 0.0))
    axes.set_ylim(-0.5, len(ranks) - 0.5)
    if row_inches >= LABEL_MIN_ROW_INCHES:
        for record, y, left, span in zip(records, ys, lefts, spans):
            if span >= LABEL_MIN_WIDTH * width:
                axes.text(left + span / 2, y, record["phase"], ha="center", va="center", fontsize=7,
                          clip_on=True, color="white" if record["state"] == BUSY else "black")
    every = -(-len(ranks) // MAX_RANK_LABELS)
    axes.set_yticks(range(0, len(ranks), every), [f"rank {rank}" for rank in ranks[::every]])
    axes.invert_yaxis()  # rank 0 on top, as in the trace viewers
    axes.set_xlim(0, width)
    axes.set_xlabel("seconds since the step began")
    steps = sorted({r["step"] for r in records})
    axes.set_title(f"step {steps[-1]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}", fontsize=9,
                   loc="left")
    states = sorted({r["state"] for r in records}, key=lambda s: (s not in STATE_COLOURS, s))
    axes.legend(handles=[Patch(color=STATE_COLOURS.get(s, OTHER_STATE_COLOUR), label=s) for s in states],
                loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(states), fontsize=7, frameon=False)
    with atomic_file(path) as tmp:
        figure.savefig(tmp, format="png")
