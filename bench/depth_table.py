"""vLLM's static speculation table (``num_speculative_tokens_per_batch_size``), written from a sweep of depths.

vLLM can speculate at a depth set per batch-size range: (first batch, last batch, depth) entries, which its
scheduler looks up every step. That is the adaptive policies' static rival: a user runs one rollout at each
fixed depth, sees which depth made tokens fastest at each batch size, and writes the table. This module
writes it the same way, so that ``tlt bench rollout`` can race it beside BEG-MAB and the goodput model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Table = list[tuple[int, int, int]]


@dataclass(frozen=True)
class DepthSweepRun:
    """One rollout at a fixed depth: each engine step's batch size and seconds, and the rollout's mean tokens
    per sequence-step (its mean acceptance length; 1.0 without speculation)."""

    step_batch_sizes: Sequence[int]
    step_seconds: Sequence[float]
    tokens_per_sequence_step: float


def bucket_ranges(bucket_bounds: Sequence[int], max_batch: int) -> list[tuple[int, int]]:
    """Inclusive batch-size ranges of the buckets (``speculation.bucket_bounds``: their upper ends), the last
    one up to ``max_batch``."""
    ranges, first = [], 1
    for bound in bucket_bounds:
        if bound >= max_batch:
            break
        ranges.append((first, bound))
        first = bound + 1
    ranges.append((first, max_batch))
    return ranges


def table_from_sweep(runs: Mapping[int, DepthSweepRun], bucket_bounds: Sequence[int], max_batch: int) -> Table:
    """Per bucket, the depth whose rollout made the most tokens per second at those batch sizes (estimated as
    batch x tokens per sequence-step over the bucket's step seconds). A bucket no run reached takes the depth
    of the bucket before it (vLLM fills gaps alike), or the best depth overall. Equal neighbours merge."""
    if not runs:
        raise ValueError("a table needs at least one fixed-depth run")

    def rate(run: DepthSweepRun, first: int, last: int) -> float | None:
        pairs = [(b, s) for b, s in zip(run.step_batch_sizes, run.step_seconds) if first <= b <= last]
        seconds = sum(s for _, s in pairs)
        return sum(b for b, _ in pairs) * run.tokens_per_sequence_step / seconds if seconds > 0 else None

    overall = max(runs, key=lambda depth: rate(runs[depth], 1, max_batch) or 0.0)
    table: Table = []
    for first, last in bucket_ranges(bucket_bounds, max_batch):
        rates = {depth: r for depth, run in runs.items() if (r := rate(run, first, last)) is not None}
        depth = max(rates, key=rates.get) if rates else (table[-1][2] if table else overall)
        if table and table[-1][2] == depth:
            table[-1] = (table[-1][0], last, depth)
        else:
            table.append((first, last, depth))
    return table


def format_table(table: Table) -> str:
    """``1-5:4, 6-21:3, 22-256:2``: how ``--vllm-table`` takes it."""
    return ", ".join(f"{first}-{last}:{depth}" for first, last, depth in table)


def parse_table(text: str) -> Table:
    """The table ``format_table`` writes (``first-last:depth`` entries, comma-separated, in order)."""
    table: Table = []
    for entry in text.split(","):
        try:
            span, depth = entry.strip().split(":")
            first, last = span.split("-")
            table.append((int(first), int(last), int(depth)))
        except ValueError:
            raise ValueError(f"table entry '{entry.strip()}' is not first-last:depth (e.g. 1-8:4)") from None
    for (first, last, depth), previous in zip(table, [None, *table]):
        if first < 1 or last < first or depth < 0 or (previous is not None and first != previous[1] + 1):
            raise ValueError(f"table '{text}': ranges must start at 1, follow each other without gaps or "
                             f"overlaps, and have depths >= 0")
    if not table or table[0][0] != 1:
        raise ValueError(f"table '{text}': the first range must start at batch size 1")
    return table
