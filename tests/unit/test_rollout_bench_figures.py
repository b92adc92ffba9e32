"""`tlt bench rollout`'s arithmetic on synthetic runs (bench/rollout_figures.py, bench/rollout_bench.py): speedups,
the long-tail phase, the lossless check."""

import pytest
from script_modules import load_script

from megatron_tlt.commands.bench_rollout import RolloutBenchSettings
from megatron_tlt.config import SpeculationConfig

# under the names bench/'s modules import each other by
figures_module = load_script("bench/rollout_figures.py", "rollout_figures")
prompt_sets = load_script("bench/rollout_bench.py", "rollout_bench").prompt_sets
BANDIT, NO_SPECULATION, ModeRun = figures_module.BANDIT, figures_module.NO_SPECULATION, figures_module.ModeRun
by_bucket, mode_figures = figures_module.by_bucket, figures_module.mode_figures
format_figures, format_step_costs = figures_module.format_figures, figures_module.format_step_costs
tail_seconds = figures_module.tail_seconds
plain_decoding_work, plain_step_line = figures_module.plain_decoding_work, figures_module.plain_step_line


def _run(seconds: float, tokens=((1, 2, 3),), batches=(4, 4, 2, 1), steps=(0.1, 0.1, 0.2, 0.3)) -> ModeRun:
    return ModeRun(seconds=seconds, tokens=60, tail_seconds=tail_seconds(list(batches), list(steps)),
                   acceptance_length=2.0, token_ids=[[list(t)] for t in tokens], step_batch_sizes=list(batches),
                   step_seconds=list(steps))


def test_the_long_tail_is_the_steps_once_half_the_sequences_are_done():
    assert tail_seconds([8, 8, 5, 4, 2, 1], [1, 1, 1, 1, 1, 1]) == 3  # batches 4, 2, 1
    assert tail_seconds([], []) == 0.0


def test_speedups_are_against_no_speculation_and_the_bandit_against_the_best_fixed_depth():
    runs = {NO_SPECULATION: [_run(2.0), _run(2.0)], "K=1": [_run(1.6), _run(1.6)], "K=2": [_run(1.0), _run(1.0)],
            BANDIT: [_run(1.25), _run(1.0)]}
    figures = mode_figures(runs, {"1": {"best": 2, "pulls": {}, "estimates": {}}}, num_prompts=3)
    assert figures["modes"]["K=2"]["speedup"] == pytest.approx(2.0)
    assert figures["best_fixed"] == "K=2" and figures["bandit_over_best_fixed"] == pytest.approx(2.0 / 2.25)
    # paired per round: K=2's time over BEG-MAB's in the same round
    assert figures["bandit_over_best_fixed_by_round"] == pytest.approx([0.8, 1.0])
    assert figures["bandit_over_best_fixed_standard_error"] == pytest.approx(0.1)
    assert figures["all_greedy_identical"]
    figures["bandit_cold_first_rollout_speedup"] = 1.0
    text = format_figures(figures)
    assert "BEG-MAB / best fixed (K=2): 0.889" in text
    assert "per round: 0.800, 1.000 (standard error of their mean 0.100)" in text


def test_an_output_that_differs_from_no_speculation_is_reported():
    runs = {NO_SPECULATION: [_run(2.0)], "K=1": [_run(1.0, tokens=((1, 2, 4),))], BANDIT: [_run(1.0)]}
    figures = mode_figures(runs, {}, num_prompts=1)
    assert not figures["modes"]["K=1"]["greedy_identical"] and not figures["all_greedy_identical"]


def test_sampled_rollouts_are_timed_paired_but_their_outputs_are_not_compared():
    runs = {NO_SPECULATION: [_run(2.0), _run(3.0)], "K=1": [_run(1.0, tokens=((1, 2, 4),)), _run(2.0)],
            BANDIT: [_run(1.0), _run(1.0)]}
    figures = mode_figures(runs, {}, num_prompts=1, sampled=True)
    assert figures["modes"]["K=1"]["greedy_identical"] is None and figures["all_greedy_identical"] is None
    # no speculation / K=1 per round: 2.0 and 1.5, so a standard error of 0.25
    assert figures["modes"]["K=1"]["speedup_by_round_standard_error"] == pytest.approx(0.25)
    figures["bandit_cold_first_rollout_speedup"] = 1.0
    text = format_figures(figures)
    assert "(draws differ)" in text and "sampled: outputs are not compared" in text and "DIFFERENT" not in text


def test_each_rollout_takes_the_next_prompts_of_the_pool_wrapping_round():
    sets = prompt_sets(list("abcde"), 2, rotate=True)
    assert [next(sets) for _ in range(4)] == [["a", "b"], ["c", "d"], ["e", "a"], ["b", "c"]]
    same = prompt_sets(list("abcde"), 2, rotate=False)
    assert [next(same) for _ in range(2)] == [["a", "b"], ["a", "b"]]
    with pytest.raises(ValueError, match="no prompts"):
        next(prompt_sets([], 2, rotate=True))
    # the warm-up round, the bandit's learning rollouts and the timed rounds each get their own prompts
    assert RolloutBenchSettings(rounds=8, bandit_warmup_rollouts=20).rollouts == 29


def test_outputs_are_compared_with_no_speculation_round_by_round():
    rounds = [((1, 2),), ((3, 4),)]  # each round has its own prompts, so its own reference
    runs = {NO_SPECULATION: [_run(2.0, tokens=t) for t in rounds], "K=1": [_run(1.0, tokens=t) for t in rounds],
            BANDIT: [_run(1.0, tokens=rounds[0]), _run(1.0, tokens=rounds[0])]}
    figures = mode_figures(runs, {}, num_prompts=1)
    assert figures["modes"]["K=1"]["greedy_identical"]
    assert not figures["modes"][BANDIT]["greedy_identical"]


def test_a_fixed_depths_step_cost_per_bucket_is_in_plain_steps_of_the_same_bucket():
    # buckets 1, 2, 3-5, 6-21, ...: two rollouts each, a crowded start and a lone request at the end
    runs = {NO_SPECULATION: [_run(1.0, batches=(8, 1), steps=(0.010, 0.005))] * 2,
            "K=4": [_run(1.0, batches=(8, 1, 1), steps=(0.026, 0.007, 0.007))] * 2}
    seconds, step_ms = by_bucket(runs, SpeculationConfig(depths=[0, 4]))
    assert seconds["K=4"] == pytest.approx({"6-21": 0.026, "1": 0.014})  # per rollout
    assert step_ms["K=4"] == pytest.approx({"6-21": 26.0, "1": 7.0})  # per step
    lines = format_step_costs(step_ms)
    assert lines[0] == "mean step per batch-size bucket: no speculation 1: 5.00 ms, 6-21: 10.00 ms"
    assert lines[1] == "  K=4 in plain steps: 1: 1.40, 6-21: 2.60"


def test_the_plain_step_line_is_fitted_to_median_steps_and_prices_the_decoding_of_given_lengths():
    # steps of 2 ms + 0.5 ms per sequence; the first step of each run also prefills (25x slower)
    steps = [(b, 0.002 + 0.0005 * b) for b in (4, 4, 3, 3, 3, 2, 1, 1)]
    runs = [_run(1.0, batches=[4] + [b for b, _ in steps], steps=[0.1] + [s for _, s in steps])] * 3
    intercept, slope = plain_step_line(runs)
    assert intercept == pytest.approx(0.002, rel=0.05) and slope == pytest.approx(0.0005, rel=0.05)
    # the prefill gives each response its first token; then a step per further token of the longest,
    # over the responses still growing: lengths 1, 3, 3 take 2 steps of 2 sequences
    assert plain_decoding_work([1, 3, 3], (1.0, 0.0)) == 2.0
    assert plain_decoding_work([1, 3, 3], (0.0, 1.0)) == 4.0
    assert plain_decoding_work([3, 1, 5], (0.0, 1.0)) == 2 + 2 + 1 + 1  # 2 live for t=1,2, then 1
    assert plain_decoding_work([], (1.0, 1.0)) == 0.0


def _sampled(seconds: float, lengths: list[int]) -> ModeRun:
    return _run(seconds, tokens=[[0] * n for n in lengths], batches=(2, 1), steps=(0.01, 0.01))


def test_on_equal_work_a_mode_that_drew_longer_responses_is_not_charged_for_them():
    # steady steps of 10 ms whatever the batch: the work is the length of the longest response
    short, long_ = [11, 6], [21, 6]  # 10 and 20 plain steps
    runs = {NO_SPECULATION: [_sampled(1.0, short), _sampled(2.0, long_)],
            "K=2": [_sampled(1.0, long_), _sampled(0.5, short)],  # 2x on either draw, its long one first
            BANDIT: [_sampled(0.5, short), _sampled(1.0, long_)]}  # also 2x
    figures = mode_figures(runs, {}, num_prompts=1, sampled=True)
    # by wall time the draws decide each round: K=2 / BEG-MAB reads 2.0 and 0.5 where both ran at 2x
    assert figures["modes"]["K=2"]["speedup"] == pytest.approx(3.0 / 1.5)
    assert figures["bandit_over_best_fixed_by_round"] == pytest.approx([2.0, 0.5])
    equal = figures["equal_work"]
    assert equal["speedup"]["K=2"] == pytest.approx(2.0) and equal["speedup"][BANDIT] == pytest.approx(2.0)
    assert equal["speedup"][NO_SPECULATION] == pytest.approx(1.0)
    assert equal["work_over_no_speculation_by_round"]["K=2"] == pytest.approx([2.0, 0.5])
    bandit = equal["over_best_fixed"][BANDIT]
    assert bandit["ratio"] == pytest.approx(1.0) and bandit["by_round"] == pytest.approx([1.0, 1.0])
    assert bandit["standard_error"] == pytest.approx(0.0)
    figures["bandit_cold_first_rollout_speedup"] = 1.0
    text = format_figures(figures)
    assert "speedup: K=2 2.00x (+-0.000), BEG-MAB 2.00x (+-0.000)" in text
    assert "BEG-MAB / best fixed (K=2): 1.000; per round 1.000, 1.000 (standard error of their mean 0.000)" in text
