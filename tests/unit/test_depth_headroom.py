"""The ceilings of adaptive speculation depth against fixed depths, from a trace (``bench/depth_ceilings.py``)."""

import pytest
from script_modules import load_script

depth_ceilings = load_script("bench/depth_ceilings.py", "depth_ceilings")
StepCost, headroom = depth_ceilings.StepCost, depth_ceilings.headroom

BOUNDS = (1,)  # two buckets: batch 1, and 2 or more


def _cost(cheap_slope=0.1, dear_slope=1.0) -> StepCost:
    """Depth costs little at batch 1 and much above: a step is 1 s plus the slope per draft position."""
    return StepCost(BOUNDS, ((1.0, cheap_slope), (1.0, dear_slope)))


def test_step_cost_fits_a_line_in_depth_per_bucket_from_pinned_steps():
    steps = [(1, 0, 1.0), (1, 0, 1.2), (1, 4, 1.5), (3, 0, 2.0), (7, 2, 3.0), (5, 4, 4.0)]
    cost = StepCost.fit(steps, BOUNDS)
    assert cost.seconds(1, 0) == pytest.approx(1.1, rel=1e-6)  # the mean at depth 0
    assert cost.seconds(1, 4) == pytest.approx(1.5, rel=1e-6)
    assert cost.seconds(6, 2) == pytest.approx(3.0, rel=1e-6) and cost.seconds(6, 8) == pytest.approx(6.0, rel=1e-6)


def test_a_bucket_measured_at_one_depth_has_no_slope_to_weigh():
    with pytest.raises(ValueError, match="bucket 1 .* 1 depth"):
        StepCost.fit([(1, 0, 1.0), (1, 4, 1.5), (3, 4, 2.0)], BOUNDS)


def test_buckets_above_the_widest_batch_measured_are_dropped_and_the_last_one_runs_to_the_top():
    cost = StepCost.fit([(1, 0, 1.0), (1, 2, 1.2), (3, 0, 2.0), (3, 2, 3.0)], (1, 4, 8))
    assert cost.bucket_bounds == (1,)
    assert cost.seconds(20, 2) == pytest.approx(3.0, rel=1e-6)  # batch 20 falls in the 2+ bucket measured at 3
    whole = StepCost.fit([(1, 0, 1.0), (3, 2, 3.0)], (3, 8))  # no bound below the widest batch: one bucket
    assert whole.bucket_bounds == () and whole.seconds(1, 1) == pytest.approx(2.0, rel=1e-6)


def test_where_the_best_depth_differs_by_batch_size_the_per_bucket_choice_beats_every_fixed_depth():
    # batch 1: the request accepts both drafts; batch 2: neither request accepts any
    trace = [[[("a", 2)], [("b", 0), ("c", 0)]]]
    result = headroom(trace, max_depth=2, cost=_cost())
    # the batch-1 step's 3 tokens take 3 / 1.65 / 1.2 s at K = 0 / 1 / 2; the batch-2 step's 2 take 1 / 2 / 3 s
    assert result.fixed == pytest.approx({0: 4.0, 1: 3.65, 2: 4.2})
    assert result.best_fixed_depth == 1
    assert result.per_bucket == pytest.approx(2.2) and result.per_bucket_depths == {0: 2, 1: 0}
    assert result.gain(result.per_bucket) == pytest.approx(3.65 / 2.2)
    assert result.clairvoyant == pytest.approx(2.2) and result.steps == 2


def test_where_one_depth_is_best_at_every_batch_size_no_choice_by_batch_size_gains():
    trace = [[[("a", 2)], [("b", 2), ("c", 2)]]]  # every draft accepted; depth is cheap enough everywhere
    result = headroom(trace, max_depth=2, cost=_cost(dear_slope=0.2))
    assert result.best_fixed_depth == 2 and result.per_bucket_depths == {0: 2, 1: 2}
    assert result.gain(result.per_bucket) == pytest.approx(1.0)


def test_reading_the_last_outcome_pays_only_where_acceptance_comes_in_streaks():
    """One request at batch 1 whose acceptance runs in streaks (all drafts, then none, three steps each): after a
    full step the next is full two times in three, after an empty one empty two times in three."""
    streaks = [[[("a", accepted)] for accepted in [4, 4, 4, 0, 0, 0] * 4]]
    result = headroom(streaks, max_depth=4, cost=_cost(cheap_slope=0.3))
    assert result.gain(result.per_bucket_and_last_outcome) > result.gain(result.per_bucket) >= 1.0
    assert result.clairvoyant < result.per_bucket_and_last_outcome
    # the same outcomes in an order where the next is full or empty alike after either: nothing to read
    no_streaks = [[[("a", accepted)] for accepted in [4, 4, 0, 0] * 6]]
    flat = headroom(no_streaks, max_depth=4, cost=_cost(cheap_slope=0.3))
    # (only the request's first step, alone in its class, gets a depth of its own: under 1%)
    assert flat.gain(flat.per_bucket_and_last_outcome) < 1.01 * flat.gain(flat.per_bucket)
    assert result.gain(result.per_bucket_and_last_outcome) > 1.04 * result.gain(result.per_bucket)


def test_depths_beyond_the_trace_and_an_empty_trace_are_refused():
    with pytest.raises(ValueError, match="0..2, the traced depth"):
        headroom([[[("a", 1)]]], max_depth=2, cost=_cost(), depths=[0, 3])
    with pytest.raises(ValueError, match="no step with drafts"):
        headroom([[[], []]], max_depth=2, cost=_cost())
