"""The rollout's speedup over depth 0, estimated from its own steps and the depth policy's rates."""

import pytest

from megatron_tlt.spec.speedup_estimate import speedup_over_depth0


def _rates(table: dict[tuple[int, int], float]):
    return lambda batch, depth: table.get((batch, depth))


def test_each_step_counts_as_the_depth0_time_of_the_tokens_it_made():
    # at batch 8 depth 3 makes tokens 2x as fast as depth 0; at batch 2 depth 2 makes them 1.5x as fast
    rate = _rates({(8, 0): 100.0, (8, 3): 200.0, (2, 0): 40.0, (2, 2): 60.0})
    steps = [(8, 3, 1.0), (8, 3, 1.0), (2, 2, 2.0), (2, 0, 1.0)]  # a depth-0 step counts as itself
    assert speedup_over_depth0(steps, rate) == pytest.approx((2 * 2.0 + 2.0 * 1.5 + 1.0) / 5.0)


def test_steps_the_policy_has_no_rates_for_are_left_out_and_too_few_known_give_none():
    rate = _rates({(8, 0): 100.0, (8, 3): 300.0})
    assert speedup_over_depth0([(8, 3, 3.0), (5, 3, 2.0)], rate) == pytest.approx(3.0)  # 60% of the time known
    assert speedup_over_depth0([(8, 3, 1.0), (5, 3, 2.0)], rate) is None  # 33%
    assert speedup_over_depth0([], rate) is None
    assert speedup_over_depth0([(8, 3, 1.0)], _rates({(8, 3): 300.0, (8, 0): 0.0})) is None  # no depth-0 rate
