"""How much faster a speculative rollout ran than its engine would have at depth 0: an estimate from its steps.

A run with TLT on never decodes the same rollout without speculation, so the console cannot show a measured
speedup. The depth policy, though, keeps measured tokens per second for each depth at each batch size,
depth 0 (no drafting) among them: BEG-MAB from its reward windows, the goodput model from its fitted step cost
and acceptance. For a step that ran t seconds at depth K with B requests in flight, depth 0 would have taken
t x r(B, K) / r(B, 0) to make the same tokens. The estimate is the sum of those times over the sum of the t,
over the steps whose two rates the policy knows.

What it is not: the speedup over TLT off. Depth 0 on a speculating engine is not a plain engine. vLLM's EAGLE
engine still does work for its drafter at depth 0: on this CPU it ran at 0.82x a plain engine's speed
(`tlt bench rollout --sampled --depths 0,4`, bench/RESULTS.md), so this figure is above the gain over plain
decoding. `bench/tlt_end_to_end.py` measures
that gain side by side. The rates are also the policy's own (medians over a window, or a fit), and steps that
prefill count like decode steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

MIN_COVERAGE = 0.5
"""Least share of the rollout's step time whose rates must be known for an estimate."""


def speedup_over_depth0(steps: Sequence[tuple[int, int, float]], rate: Callable[[int, int], float | None]) -> float | None:
    """``steps``: (requests in flight, depth, seconds) of each engine step; ``rate(batch, depth)``: the depth
    policy's tokens per second, None where it has none. Returns (the time depth 0 would have taken) / (the time
    taken), or None when the steps with known rates hold less than ``MIN_COVERAGE`` of the time."""
    total = sum(seconds for _, _, seconds in steps)
    covered = at_depth0 = 0.0
    for batch, depth, seconds in steps:
        if depth == 0:  # ran at depth 0
            covered, at_depth0 = covered + seconds, at_depth0 + seconds
            continue
        speculative, baseline = rate(batch, depth), rate(batch, 0)
        if speculative is None or not baseline:
            continue
        covered += seconds
        at_depth0 += seconds * speculative / baseline
    if total <= 0 or covered < MIN_COVERAGE * total:
        return None
    return at_depth0 / covered
