"""How much could an adaptive speculation depth gain over the best fixed depth? Ceilings, from a trace
(``bench/depth_headroom.py`` records the trace and prints them).

A rollout speculating at the deepest depth Kmax records, at every engine step, how many of its Kmax drafts each
request accepted (``RolloutResult.step_drafts``). A request that accepted ``a`` of Kmax drafts would have accepted
min(a, K) of K: its first K drafts are the same draws, judged alike up to the first rejection. So the traced step
would have made tokens(K) = sum over its requests of (min(a, K) + 1) at depth K, in t(B, K) seconds for its batch B
(``StepCost``, measured at pinned depths). To make the traced step's tokens at depth K takes

    time(K) = t(B, K) * tokens(Kmax) / tokens(K)       (more steps where each makes fewer tokens)

Summed over the traced steps, each way of choosing K gets the time it would take for the same work:
  * ``fixed[K]``: K at every step; the best of them is the yardstick;
  * ``per_bucket``: the best K of each batch-size bucket, chosen knowing the whole trace: the ceiling of any
    choice by batch size (BEG-MAB, vLLM's per-batch-size table);
  * ``per_bucket_and_last_outcome``: the best K per bucket and per how the step's requests did at their previous
    step (the median of their previous acceptance, in quarters of Kmax, or new): the ceiling of a choice that also
    reads the last step's outcome (an acceptance streak), as the goodput model and draft-length heuristics do;
  * ``clairvoyant``: each step at its own best depth, knowing its outcome: no policy can do better.
The best choices are made in-sample, knowing the trace, and so are optimistic; an adaptive policy also pays to
explore. A step's batch is the requests that drafted in it (a step that also prefills new prompts counts as its
decoding part).
"""

from __future__ import annotations

import bisect
import dataclasses
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

Step = Sequence[tuple[str, int]]
"""(request, drafts accepted) of each request a step verified."""


def _bucket_of(bounds: tuple[int, ...], batch: int) -> int:
    """The bucket of ``batch``: bounds are inclusive upper ends, as ``speculation.bucket_bounds`` (BEG-MAB's)."""
    return bisect.bisect_left(bounds, batch)


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Seconds of an engine step at batch B and depth K: a line in K per batch-size bucket, t_b(K) = a_b + s_b K,
    fitted to the mean step of each pinned depth there (weighted by its steps)."""

    bucket_bounds: tuple[int, ...]
    lines: tuple[tuple[float, float], ...]
    """(a_b, s_b) per bucket: the bounds' buckets, then the one above the last bound."""

    @classmethod
    def fit(cls, steps: Iterable[tuple[int, int, float]], bucket_bounds: Sequence[int]) -> StepCost:
        """From (batch, depth, seconds) of steps run at pinned depths; every bucket needs steps at two depths
        or more, since the line's slope is what the choice of depth weighs. Bounds at or above the widest batch
        measured are dropped: no step lies above them, and the last bucket measured runs to the top."""
        steps = list(steps)
        widest = max((batch for batch, _, _ in steps), default=0)
        bounds = tuple(b for b in bucket_bounds if b < widest)
        by_cell: dict[tuple[int, int], list[float]] = defaultdict(list)
        for batch, depth, seconds in steps:
            by_cell[(_bucket_of(bounds, batch), depth)].append(seconds)
        lines = []
        for bucket in range(len(bounds) + 1):
            cells = sorted((depth, times) for (b, depth), times in by_cell.items() if b == bucket)
            if len({depth for depth, _ in cells}) < 2:
                raise ValueError(f"batch-size bucket {bucket} (bounds {bounds}) has steps at "
                                 f"{len(cells)} depth(s); a step-cost line needs two or more")
            slope, intercept = np.polyfit([d for d, _ in cells], [statistics.fmean(t) for _, t in cells], 1,
                                          w=[len(t) ** 0.5 for _, t in cells])
            lines.append((float(intercept), float(slope)))
        return cls(bounds, tuple(lines))

    def bucket_of(self, batch: int) -> int:
        return _bucket_of(self.bucket_bounds, batch)

    def seconds(self, batch: int, depth: int) -> float:
        intercept, slope = self.lines[self.bucket_of(batch)]
        return intercept + slope * depth


@dataclasses.dataclass(frozen=True)
class Headroom:
    """Seconds the traced work would take under each way of choosing the depth (module docstring)."""

    fixed: dict[int, float]
    per_bucket: float
    per_bucket_depths: dict[int, int]
    """The best depth of each bucket (by index), chosen knowing the trace."""
    per_bucket_and_last_outcome: float
    clairvoyant: float
    steps: int

    @property
    def best_fixed_depth(self) -> int:
        return min(self.fixed, key=lambda k: (self.fixed[k], k))

    def gain(self, seconds: float) -> float:
        """How many times faster than the best fixed depth ``seconds`` is."""
        return self.fixed[self.best_fixed_depth] / seconds


def _last_outcome_class(step: Step, last: Mapping[str, int], max_depth: int) -> str:
    previous = [last[request] for request, _ in step if request in last]
    if not previous:
        return "new"
    return f"q{min(int(4 * statistics.median(previous) / max_depth), 3)}"  # q3 holds the full drafts too


def headroom(rollouts: Iterable[Sequence[Step]], max_depth: int, cost: StepCost,
             depths: Sequence[int] | None = None) -> Headroom:
    """The ceilings of adaptive depth against fixed depths over ``rollouts`` traced at ``max_depth`` (each a list
    of steps); ``depths``: the depths to choose among (default 0..max_depth, none deeper than the trace)."""
    depths = sorted(set(range(max_depth + 1) if depths is None else depths))
    if not depths or depths[0] < 0 or depths[-1] > max_depth:
        raise ValueError(f"depths {depths} must lie in 0..{max_depth}, the traced depth")
    per_step: list[tuple[int, str, np.ndarray]] = []  # (bucket, last-outcome class, time at each depth)
    for steps in rollouts:
        last: dict[str, int] = {}
        for step in steps:
            if step:
                accepted = np.array([min(count, max_depth) for _, count in step])
                made = np.array([np.minimum(accepted, k).sum() + len(accepted) for k in depths], dtype=np.float64)
                traced_work = accepted.sum() + len(accepted)
                times = np.array([cost.seconds(len(step), k) for k in depths]) * traced_work / made
                per_step.append((cost.bucket_of(len(step)), _last_outcome_class(step, last, max_depth), times))
            last.update(step)
    if not per_step:
        raise ValueError("the trace holds no step with drafts")
    total = np.sum([times for _, _, times in per_step], axis=0)

    def best_of_groups(key: Callable[[int, str], object]) -> tuple[float, dict]:
        groups: dict[object, np.ndarray] = defaultdict(lambda: np.zeros(len(depths)))
        for bucket, outcome, times in per_step:
            groups[key(bucket, outcome)] += times
        return (float(sum(g.min() for g in groups.values())),
                {group: depths[int(np.argmin(g))] for group, g in groups.items()})

    per_bucket, bucket_depths = best_of_groups(lambda bucket, _: bucket)
    per_outcome, _ = best_of_groups(lambda bucket, outcome: (bucket, outcome))
    return Headroom(fixed={k: float(t) for k, t in zip(depths, total)}, per_bucket=per_bucket,
                    per_bucket_depths=dict(sorted(bucket_depths.items())), per_bucket_and_last_outcome=per_outcome,
                    clairvoyant=float(sum(times.min() for _, _, times in per_step)), steps=len(per_step))
