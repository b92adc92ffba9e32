"""The table that tells vLLM where the bandit may speculate (its CUDA-graph capture tiers), read back
through vLLM's own dense lookup."""

from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

from megatron_tlt.config import SpeculationConfig
from megatron_tlt.spec.cuda_graphs import speculation_schedule


def test_speculative_shapes_only_up_to_the_largest_batch_that_may_speculate():
    settings = SpeculationConfig(depths=[0, 1, 2, 3], max_speculative_batch=32)
    schedule = speculation_schedule(settings, max_depth=4, max_num_seqs=256)
    assert schedule == [(1, 32, 3), (33, 256, 0)]
    dense = build_dynamic_sd_schedule_lookup(schedule, vllm_max_batch_size=256, vllm_num_speculative_tokens=4)
    assert dense[1] == dense[32] == 3 and set(dense[33:]) == {0}


def test_without_a_limit_or_beyond_max_num_seqs_every_batch_may_speculate():
    assert speculation_schedule(SpeculationConfig(max_speculative_batch=None), 3, 64) == [(1, 64, 3)]
    assert speculation_schedule(SpeculationConfig(max_speculative_batch=500), 3, 64) == [(1, 64, 3)]


def test_a_bandit_with_depth_zero_only_never_speculates():
    assert speculation_schedule(SpeculationConfig(depths=[0]), 3, 64) == [(1, 64, 0)]
