"""The neighbour-slowdown estimate compares like with like (same rank, batch size and depth), with and without
another rank training, and the duty-cycle controller backs off above the bound and recovers slowly below it.

Every input is built by hand: step times and training spans on an invented clock, so each figure is exact."""

import pytest

from megatron_tlt.drafter.neighbour_slowdown import (DutyCycleController, EngineStep, engine_steps,
                                                     neighbour_slowdown, trimmed_mean)

STEP = 0.010  # a clean step's seconds at batch 4


def _run(batch: int, seconds: list[float], start: float = 0.0, depth: int | None = None) -> list[EngineStep]:
    """Back-to-back steps from ``start``."""
    steps, t = [], start
    for s in seconds:
        steps.append(EngineStep(t, s, batch, depth))
        t += s
    return steps


def test_steps_ten_percent_slower_while_a_neighbour_trains_give_a_slowdown_of_1_10():
    clean = _run(4, [STEP] * 10, start=0.0)
    slowed = _run(4, [1.1 * STEP] * 10, start=1.0)
    training = {1: [(1.0 - 0.01, 1.0 + 10 * 1.1 * STEP + 0.01)]}  # covers every slowed step
    result = neighbour_slowdown({0: clean + slowed}, training)
    assert result.slowdown == pytest.approx(1.10)
    assert (result.cells, result.overlapped_steps, result.clean_steps, result.unmatched_overlapped_steps) == (1, 10, 10, 0)
    overlapped = 10 * 1.1 * STEP
    assert result.overlapped_share == pytest.approx(overlapped / (10 * STEP + overlapped))
    assert result.rollout_cost == pytest.approx((1 - 1 / 1.1) * overlapped / (10 * STEP + overlapped))


def test_cells_pool_weighted_by_their_overlapped_steps_time():
    # batch 8: 20% slower over 2 steps of 0.03 s; batch 4: 10% slower over 8 steps of 0.01 s
    steps = (_run(8, [0.03] * 2) + _run(8, [0.036] * 2, start=1.0)
             + _run(4, [STEP] * 8, start=2.0) + _run(4, [1.1 * STEP] * 8, start=3.0))
    training = {1: [(1.0, 1.1), (3.0, 3.2)]}
    result = neighbour_slowdown({0: steps}, training)
    assert result.slowdown == pytest.approx((2 * 0.036 + 8 * 0.011) / (2 * 0.03 + 8 * 0.01))
    assert result.cells == 2


def test_a_small_batch_step_that_overlaps_training_does_not_count_as_slowdown():
    # The long tail: big batches ran clean and slow, the tail's small batches fast, some while rank 1 trained.
    # Pooled without cells, the overlapped steps would look *faster*; the tail's last batch size ran only while
    # rank 1 trained, so it has nothing to be compared with and stays out.
    steps = (_run(8, [0.05] * 10)
             + _run(2, [STEP] * 6, start=1.0) + _run(2, [STEP] * 6, start=2.0)
             + _run(1, [0.5 * STEP] * 4, start=3.0))
    training = {1: [(2.0, 2.0 + 6 * STEP), (3.0, 3.1)]}
    result = neighbour_slowdown({0: steps}, training)
    assert result.slowdown == pytest.approx(1.0)
    assert (result.cells, result.overlapped_steps, result.unmatched_overlapped_steps) == (1, 6, 4)


def test_depths_are_cells_of_their_own():
    # at batch 4, depth 3 steps are slower than depth 0 ones by their own nature, and ran while rank 1 trained
    steps = (_run(4, [STEP] * 4, depth=0) + _run(4, [2 * STEP] * 4, start=1.0, depth=3)
             + _run(4, [STEP] * 4, start=2.0, depth=0) + _run(4, [2 * STEP] * 4, start=3.0, depth=3))
    training = {1: [(1.0, 1.1), (2.0, 2.1)]}  # overlaps depth 3 then depth 0: each depth has both kinds
    result = neighbour_slowdown({0: steps}, training)
    assert result.slowdown == pytest.approx(1.0) and result.cells == 2


def test_without_overlapped_steps_there_is_no_estimate():
    steps = {0: _run(4, [STEP] * 10)}
    for training in ({}, {1: [(5.0, 6.0)]}, {0: [(0.0, 1.0)]}):  # none; after the rollout; the rank's own
        result = neighbour_slowdown(steps, training)
        assert result.slowdown is None and result.rollout_cost is None and result.cells == 0
        assert result.overlapped_share == 0.0


def test_a_step_covered_less_than_half_is_neither_kind_and_one_covered_more_is_overlapped():
    steps = _run(4, [STEP] * 3) + _run(4, [1.1 * STEP] * 2, start=1.0) + [EngineStep(2.0, 5 * STEP, 4)]
    training = {1: [(1.0 + 0.6 * 1.1 * STEP, 1.0 + 1.6 * 1.1 * STEP),  # 40% of the first, 60% of the second
                    (2.0, 2.0 + 2 * STEP)]}  # 40% of the long step
    result = neighbour_slowdown({0: steps}, training, min_steps_per_kind=1)
    assert (result.overlapped_steps, result.clean_steps) == (1, 3)
    assert result.slowdown == pytest.approx(1.10)


def test_an_outlier_step_is_trimmed_away():
    slowed = [1.1 * STEP] * 9 + [30 * STEP]  # one step the OS stalled
    steps = _run(4, [STEP] * 10) + _run(4, slowed, start=1.0)
    result = neighbour_slowdown({0: steps}, {1: [(1.0, 2.0)]})
    assert result.slowdown == pytest.approx(1.10)
    assert trimmed_mean([1.0, 2.0, 9.0]) == 2.0 and trimmed_mean([1.0, 3.0]) == 2.0


def test_the_cost_is_the_worst_hit_generating_rank():
    # rank 0: all its time overlapped by rank 2's training; rank 1: a quarter of it
    rank0 = _run(4, [STEP] * 4) + _run(4, [1.1 * STEP] * 12, start=1.0)
    rank1 = _run(4, [STEP] * 12, start=5.0) + _run(4, [1.1 * STEP] * 4, start=1.0)
    training = {2: [(1.0, 1.2)]}
    result = neighbour_slowdown({0: rank0, 1: rank1}, training)
    assert result.slowdown == pytest.approx(1.10) and result.cells == 2
    share0 = 12 * 1.1 * STEP / (4 * STEP + 12 * 1.1 * STEP)
    assert result.rollout_cost == pytest.approx((1 - 1 / 1.1) * share0)


def test_engine_steps_zips_the_rollouts_lists_and_leaves_an_unmatched_depth_log_unknown():
    assert engine_steps([0.0, 1.0], [0.1, 0.2], [4, 3], [2, 0]) == [EngineStep(0.0, 0.1, 4, 2), EngineStep(1.0, 0.2, 3, 0)]
    assert [s.depth for s in engine_steps([0.0, 1.0], [0.1, 0.2], [4, 3], [2])] == [None, None]
    with pytest.raises(ValueError, match="differ in length"):
        engine_steps([0.0], [0.1, 0.2], [4, 3])


# ------------------------------------------------------------------------------------------------ controller

def test_the_controller_halves_the_duty_cycle_above_the_bound_down_to_its_floor():
    controller = DutyCycleController(0.25)
    assert [controller.update(0.05) for _ in range(3)] == [0.125, 0.0625, 0.05]
    assert controller.update(0.05) == 0.05


def test_the_controller_raises_it_slowly_when_comfortably_below_the_bound_up_to_its_ceiling():
    controller = DutyCycleController(0.25)
    controller.update(0.03)
    assert controller.update(0.005) == pytest.approx(0.1375)  # 0.125 x 1.1
    for _ in range(20):
        controller.update(0.0)
    assert controller.duty_cycle == 0.25  # the configured duty cycle is the ceiling
    assert controller.update(-0.01) == 0.25  # a slowdown below 1 (noise) is comfortable too


def test_the_controller_holds_without_an_estimate_and_between_half_the_bound_and_the_bound():
    controller = DutyCycleController(0.5, ceiling=1.0)
    for cost in (None, float("nan"), 0.01, 0.015, 0.02):
        assert controller.update(cost) == 0.5


def test_the_controller_refuses_impossible_limits():
    with pytest.raises(ValueError, match="floor <= duty_cycle <= ceiling"):
        DutyCycleController(0.5, ceiling=0.4)
    with pytest.raises(ValueError, match="floor <= duty_cycle"):
        DutyCycleController(0.5, floor=0.0)
    with pytest.raises(ValueError, match="decrease"):
        DutyCycleController(0.5, decrease=1.0)
    assert DutyCycleController(0.02).floor == 0.02  # a configured duty cycle below the default floor


def test_the_controller_state_round_trips_and_obeys_the_resumed_limits():
    controller = DutyCycleController(0.25)
    controller.update(0.1)
    resumed = DutyCycleController(0.25)
    resumed.load_state_dict(controller.state_dict())
    assert resumed.duty_cycle == controller.duty_cycle == 0.125
    assert [resumed.update(c) for c in (0.0, 0.1)] == [controller.update(c) for c in (0.0, 0.1)]
    tighter = DutyCycleController(0.1)
    tighter.load_state_dict({"duty_cycle": 0.25})
    assert tighter.duty_cycle == 0.1
