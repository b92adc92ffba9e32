"""How much a rank's drafter training slows the ranks still generating on its machine, and a duty cycle that
backs off when that costs the rollout too much.

Where ranks share a memory bus (a CPU; on GPUs the host side and PCIe), an idle rank that trains the drafter can
slow the ranks still decoding, which are the rollout's critical path. ``neighbour_slowdown`` measures it from one
rollout's own engine steps, like with like: an engine step's time depends on how many sequences are in flight
and on its speculation depth, so steps are compared only within a cell (generating rank, batch size, depth),
those that ran while another rank trained against those that ran while none did, and the cells are pooled.
``DutyCycleController`` turns that into the spot trainer's duty cycle for the next rollout.

Pure: numbers in, numbers out; no I/O, no process groups, no torch.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Hashable, Mapping, Sequence

OVERLAP_MIN = 0.5
"""Least share of an engine step covered by other ranks' training for the step to count as overlapped."""
TRIM = 0.2
"""Share of a cell's step times trimmed from each end before averaging (a 20% trimmed mean)."""
MIN_STEPS_PER_KIND = 2
"""Least overlapped and least clean steps a cell needs to enter the estimate."""


@dataclasses.dataclass(frozen=True)
class EngineStep:
    """One engine step of a generating rank (``RolloutResult.step_started_at/step_seconds/step_batch_sizes/
    step_depths``)."""

    started_at: float
    """Wall-clock start, ``time.time()``: the clock of the ranks' timeline spans."""
    seconds: float
    batch_size: int
    """Sequences in flight."""
    depth: int | None = None
    """Speculation depth; None where the engine does not choose depths (all its steps then share one)."""


def engine_steps(started_at: Sequence[float], seconds: Sequence[float], batch_sizes: Sequence[int],
                 depths: Sequence[int] = ()) -> list[EngineStep]:
    """A rollout's steps from its parallel per-step lists. ``depths`` is used only where it has one entry per
    step (an engine without adaptive speculation, or whose depth log does not line up, leaves it unknown)."""
    if not len(started_at) == len(seconds) == len(batch_sizes):
        raise ValueError(f"per-step lists differ in length: {len(started_at)} starts, {len(seconds)} times, "
                         f"{len(batch_sizes)} batch sizes")
    known = len(depths) == len(seconds)
    return [EngineStep(t0, s, b, depths[i] if known else None)
            for i, (t0, s, b) in enumerate(zip(started_at, seconds, batch_sizes))]


@dataclasses.dataclass(frozen=True)
class NeighbourSlowdown:
    """What one rollout says about the slowdown other ranks' training caused its generating ranks."""

    slowdown: float | None
    """Overlapped steps' time / the time the same cells' clean steps took (1.10: 10% slower); None where no cell
    has enough steps of both kinds."""
    rollout_cost: float | None
    """Share of its generating time the slowdown added to the worst-hit generating rank (the long tail's rank,
    the critical path): (1 - 1/slowdown) x its overlapped steps' seconds / its steps' seconds. What the duty cycle
    controls; None with ``slowdown``; at most 0 where noise puts ``slowdown`` below 1."""
    overlapped_steps: int
    """Overlapped steps in the cells the estimate rests on."""
    clean_steps: int
    """Clean steps in the cells the estimate rests on."""
    cells: int
    """Cells (rank, batch size, depth) the estimate rests on."""
    unmatched_overlapped_steps: int
    """Overlapped steps in cells without enough of both kinds: not measured (e.g. the tail's last batch sizes,
    which ran only while others trained)."""
    overlapped_share: float
    """Share of all generating ranks' step seconds during which another rank trained."""


def _union(intervals: Sequence[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Disjoint sorted (starts, ends) covering the same time as ``intervals``; empty ones dropped."""
    starts: list[float] = []
    ends: list[float] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if ends and start <= ends[-1]:
            ends[-1] = max(ends[-1], end)
        else:
            starts.append(start)
            ends.append(end)
    return starts, ends


def _covered_seconds(start: float, end: float, union: tuple[list[float], list[float]]) -> float:
    starts, ends = union
    covered = 0.0
    i = max(bisect.bisect_right(starts, start) - 1, 0)
    while i < len(starts) and starts[i] < end:
        covered += max(0.0, min(end, ends[i]) - max(start, starts[i]))
        i += 1
    return covered


def trimmed_mean(values: Sequence[float], trim: float = TRIM) -> float:
    """Mean after dropping round(n x trim) values from each end (never all: 3 values at 0.2 give the median)."""
    ordered = sorted(values)
    k = min(int(len(ordered) * trim + 0.5), (len(ordered) - 1) // 2)
    kept = ordered[k:len(ordered) - k]
    return sum(kept) / len(kept)


def neighbour_slowdown(steps_by_rank: Mapping[Hashable, Sequence[EngineStep]],
                       training_by_rank: Mapping[Hashable, Sequence[tuple[float, float]]], *,
                       overlap_min: float = OVERLAP_MIN, trim: float = TRIM,
                       min_steps_per_kind: int = MIN_STEPS_PER_KIND) -> NeighbourSlowdown:
    """The slowdown of generating ranks' engine steps while other ranks of the machine trained the drafter.

    Args:
        steps_by_rank: each generating rank's engine steps in one rollout.
        training_by_rank: each rank's TRAINING spans (start, end) in that rollout, on the steps' clock; a rank's
            own spans never count against its steps. Pass the ranks of one machine only: training elsewhere
            shares no bus with these steps.
        overlap_min: a step is *overlapped* when other ranks' training covers at least this share of it, *clean*
            when it covers none of it; steps in between belong to neither kind.
        trim: share trimmed from each end of a cell's step times before averaging.
        min_steps_per_kind: least overlapped and least clean steps a cell needs to be used.

    The estimate: in each cell c = (rank, batch size, depth) with enough steps of both kinds, the trimmed means
    O_c (overlapped) and C_c (clean); slowdown = sum_c n_c O_c / sum_c n_c C_c, n_c the cell's overlapped steps:
    the time the overlapped steps took over the time they would have taken clean, so cells weigh by the time at
    stake, and a cell of two steps cannot swing it like a cell of two hundred.

    Why trimmed means: on a shared machine step times have a heavy right tail (the OS scheduler, a collector
    pass, a prefill landing at a decode batch size), and one such step in a small cell would read as a slowdown
    or hide one. A 20% trimmed mean drops those tails yet, unlike a median, still averages the bulk, so a
    slowdown that shows as a shift of most steps is measured at its size. A median of per-cell ratios would be
    robust too but would weigh a cell of two steps like a cell of two hundred.

    Assumptions:
      * Within a cell a step's time depends only on whether another rank trained meanwhile: the sequences'
        lengths (attention over a longer context late in a rollout) move step times little within one cell.
      * The clean steps are the baseline "no other rank trains": other ranks may have been generating, resting
        (duty cycle below 1) or idle then. Where a clean step ran beside a still-generating rank, that rank's
        own contention is in the baseline, so the slowdown is of training over generating, an underestimate of
        training over nothing; in the long tail, where the spot trainer runs, neighbours are mostly resting.
      * An overlapped step is slowed over its whole length, a step covered less than ``overlap_min`` not at all;
        the two errors offset roughly, and engine steps are usually shorter than a drafter micro-step.
      * The depth is the engine's choice per step; None (no adaptive speculation) is one depth.
    With training at duty cycle 1 few clean steps fall in the tail's cells, and there may be no estimate.
    """
    total = covered_total = 0.0
    per_cell: dict[tuple, tuple[list[float], list[float]]] = {}
    overlapped_seconds: dict[Hashable, float] = {}
    rank_seconds: dict[Hashable, float] = {}
    for rank, steps in steps_by_rank.items():
        union = _union([span for other, spans in training_by_rank.items() if other != rank
                                       for span in spans])
        overlapped_seconds[rank] = rank_seconds[rank] = 0.0
        for step in steps:
            if step.seconds <= 0:
                continue
            covered = _covered_seconds(step.started_at, step.started_at + step.seconds, union)
            total += step.seconds
            covered_total += covered
            rank_seconds[rank] += step.seconds
            overlapped, clean = per_cell.setdefault((rank, step.batch_size, step.depth), ([], []))
            if covered >= overlap_min * step.seconds:
                overlapped.append(step.seconds)
                overlapped_seconds[rank] += step.seconds
            elif covered <= 0.0:
                clean.append(step.seconds)

    slowed = baseline = 0.0
    cells = used_overlapped = used_clean = unmatched = 0
    for overlapped, clean in per_cell.values():
        if len(overlapped) < min_steps_per_kind or len(clean) < min_steps_per_kind:
            unmatched += len(overlapped)
            continue
        cells, used_overlapped, used_clean = cells + 1, used_overlapped + len(overlapped), used_clean + len(clean)
        slowed += len(overlapped) * trimmed_mean(overlapped, trim)
        baseline += len(overlapped) * trimmed_mean(clean, trim)

    slowdown = slowed / baseline if cells else None
    cost = None
    if slowdown is not None:
        cost = max((1.0 - 1.0 / slowdown) * overlapped_seconds[rank] / rank_seconds[rank]
                   for rank in rank_seconds if rank_seconds[rank] > 0)
    return NeighbourSlowdown(slowdown=slowdown, rollout_cost=cost, overlapped_steps=used_overlapped,
                             clean_steps=used_clean, cells=cells, unmatched_overlapped_steps=unmatched,
                             overlapped_share=covered_total / total if total > 0 else 0.0)


class DutyCycleController:
    """The spot trainer's duty cycle, rollout to rollout: multiplicative decrease when training cost the critical
    path more than ``bound``, slow multiplicative increase when it cost less than ``comfort x bound``, no change
    in between or without an estimate. Deterministic; its state is the duty cycle alone.

    It acts on ``NeighbourSlowdown.rollout_cost``, not on ``slowdown``: a step overlapped by training is slowed by
    about the same factor at any duty cycle (the duty cycle sets how much of the rollout is overlapped, not how
    hard each overlapped step is hit), so only the cost answers a change of duty cycle; roughly in proportion.
    With that proportion, a decrease by ``decrease`` = 0.5 from just above the bound lands near the band's lower
    edge, and an increase by at most ``1 / comfort`` never jumps over the bound, so the cycle settles in the band.

    Args:
        duty_cycle: the configured duty cycle, where it starts.
        bound: the cost (share of the rollout) above which it backs off; 0.02, the project's target.
        floor: least duty cycle (> 0: some training keeps measuring the cost and keeps the drafter learning);
            default 0.05, or the starting duty cycle where that is lower.
        ceiling: most duty cycle; default the configured one, which is the user's limit: the controller backs
            off from it and recovers to it, never beyond (a machine where more would be harmless is run with a
            higher configured duty cycle).
        decrease: factor applied above the bound.
        increase: factor applied below ``comfort x bound`` (1.1: from half back to full in about 7 rollouts).
        comfort: share of the bound under which the cost counts as comfortably low.
    """

    def __init__(self, duty_cycle: float, *, bound: float = 0.02, floor: float | None = None,
                 ceiling: float | None = None, decrease: float = 0.5, increase: float = 1.1, comfort: float = 0.5):
        ceiling = duty_cycle if ceiling is None else ceiling
        floor = min(0.05, duty_cycle) if floor is None else floor
        if not 0.0 < floor <= duty_cycle <= ceiling <= 1.0:
            raise ValueError(f"need 0 < floor <= duty_cycle <= ceiling <= 1, got floor {floor}, duty_cycle "
                             f"{duty_cycle}, ceiling {ceiling}")
        if not bound > 0 or not 0 < decrease < 1 or not increase > 1 or not 0 < comfort < 1:
            raise ValueError(f"need bound > 0, 0 < decrease < 1, increase > 1 and 0 < comfort < 1; got bound "
                             f"{bound}, decrease {decrease}, increase {increase}, comfort {comfort}")
        self.bound, self.floor, self.ceiling = bound, floor, ceiling
        self.decrease, self.increase, self.comfort = decrease, increase, comfort
        self._duty_cycle = float(duty_cycle)

    @property
    def duty_cycle(self) -> float:
        return self._duty_cycle

    def update(self, rollout_cost: float | None) -> float:
        """The duty cycle for the next rollout, given the last one's cost (None or NaN: no estimate, no change)."""
        if rollout_cost is None or math.isnan(rollout_cost):
            return self._duty_cycle
        if rollout_cost > self.bound:
            self._duty_cycle = max(self.floor, self._duty_cycle * self.decrease)
        elif rollout_cost < self.comfort * self.bound:
            self._duty_cycle = min(self.ceiling, self._duty_cycle * self.increase)
        return self._duty_cycle

    def state_dict(self) -> dict:
        return {"duty_cycle": self._duty_cycle}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved duty cycle, held within this controller's [floor, ceiling] (a run resumed with
        other limits obeys the new ones)."""
        self._duty_cycle = min(self.ceiling, max(self.floor, float(state["duty_cycle"])))
