"""The flagship projection's model (bench/flagship_projection.py) on deterministic inputs."""

import json
import math

import numpy as np
import pytest

from script_modules import load_script

fp = load_script("bench/flagship_projection.py", "flagship_projection")


def _flat(batch: int, depth: int) -> float:
    return 1.0


def test_full_acceptance_advances_every_request_depth_plus_one_tokens_a_step():
    lengths = [9, 10, 27]
    result = fp.simulate_rollout(lengths, [1.0] * 4, lambda b: 4, _flat, seed=0)
    assert result.steps == math.ceil(27 / 5) and result.tokens == 46


def test_zero_acceptance_takes_as_many_steps_as_plain_decoding():
    lengths = [3, 17, 8]
    spec = fp.simulate_rollout(lengths, [0.0] * 6, lambda b: 6, _flat, seed=1)
    plain = fp.simulate_rollout(lengths, [0.5] * 6, lambda b: 0, _flat, seed=1)
    assert spec.steps == plain.steps == 17


def test_a_flat_cost_table_gives_the_ratio_of_steps_as_the_speedup():
    lengths = [40]
    plain = fp.simulate_rollout(lengths, [1.0] * 3, lambda b: 0, _flat, seed=0)
    spec = fp.simulate_rollout(lengths, [1.0] * 3, lambda b: 3, _flat, seed=0)
    assert plain.seconds / spec.seconds == pytest.approx(40 / 10)


def test_the_batch_shrinks_as_requests_finish_and_each_step_is_priced_at_its_batch():
    batches = []
    fp.simulate_rollout([1, 2, 3], [], lambda b: 0, lambda b, k: batches.append(b) or float(b), seed=0)
    assert batches == [3, 2, 1]


def test_accepted_drafts_follow_the_per_position_rates_and_the_simulation_is_deterministic():
    # p = (0.8, 0.5): a request-step accepts 0, 1, 2 drafts with probabilities 0.2, 0.3, 0.5: 2.3 tokens a step
    lengths = [100_000]
    one = fp.simulate_rollout(lengths, [0.8, 0.5], lambda b: 2, _flat, seed=3)
    assert one == fp.simulate_rollout(lengths, [0.8, 0.5], lambda b: 2, _flat, seed=3)
    assert 100_000 / one.steps == pytest.approx(2.3, rel=0.01)


def test_end_to_end_speedup_is_amdahls_law_over_the_rollout_share():
    assert fp.end_to_end_speedup(0.78, 2.5) == pytest.approx(1 / (0.22 + 0.78 / 2.5))
    assert fp.end_to_end_speedup(0.78, 1.0) == pytest.approx(1.0)
    assert fp.end_to_end_speedup(0.5, 2.0, critical_path_share=0.25) == pytest.approx(1.0)


def test_the_step_cost_table_interpolates_in_depth_then_batch_and_refuses_to_extrapolate():
    rows = [(1, 0, 1.0), (1, 4, 3.0), (3, 0, 2.0), (3, 4, 6.0)]
    cost = fp.step_cost_table(rows)
    assert cost(1, 2) == pytest.approx(2.0) and cost(2, 2) == pytest.approx(3.0) and cost(3, 4) == 6.0
    with pytest.raises(ValueError, match="outside"):
        cost(4, 0)
    with pytest.raises(ValueError, match="full grid"):
        fp.step_cost_table(rows[:3])


def test_collectives_are_added_only_for_a_tensor_parallel_shard():
    shape = dict(hidden=8, layers=2, vocab=16, tp=2)
    # verify over 2 tokens: 5 all-reduces of 2 x 8 x 2 bytes (x 2 (n-1)/n = 1) and a gather of 2 x 16 x 2 x (n-1)
    assert fp.comm_seconds(shape, 2, 0, 1.0, 1.0) == pytest.approx(5 * (1 + 32) + 1 + 64)
    assert fp.comm_seconds(dict(shape, tp=1), 2, 3, 1.0, 1.0) == 0.0


def test_the_best_depth_per_bucket_is_never_behind_the_best_fixed_depth():
    # depth costs nothing at batch 1 and much above: the per-bucket choice speculates only at batch 1
    def cost(b: int, k: int) -> float:
        return 1.0 + (0.0 if b == 1 else 2.0 * k)
    result = fp.project(lambda i: np.array([5, 30]), 2, [1.0] * 4, [0, 2, 4], cost,
                        lambda b: 0 if b == 1 else 1, 2, seed=0)
    assert result["per_bucket_depths"] == [4, 0]
    assert result["per_bucket"] <= min(result["fixed"].values()) and result["per_bucket"] < result["no_speculation"]


def test_a_trace_gives_per_position_acceptance_and_response_lengths(tmp_path):
    trace = {"depth": 2, "rollouts": [[[["a", 2], ["b", 0]], [["a", 1], ["b", 2]], [["b", 0]]]]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    acceptance, lengths = fp._from_trace(str(path))
    assert acceptance == pytest.approx([3 / 5, 2 / 5]) and sorted(lengths) == [5, 5]
