"""Adaptive depth inside vLLM: the scheduler hook picks each step's depth (BEG-MAB from the live batch size,
the goodput model from the live requests' drafts), learns from the engine's own step counts, stays lossless,
and its state survives a save and load; a pinned depth and ``tlt bench rollout``'s vLLM table (a depth policy of
the bench's, ``bench/rollout_bench.py``) run the depths they give.

Uses ``tiny_models.next_token_fixture``: a drafter that is always right (depth 3 pays) and one that is
never right (deep speculation does not pay). The scheduler's clock counts engine steps instead of
seconds, so every reward is exact on any machine, however loaded. One engine process for all checks.
"""

import dataclasses

import numpy as np
import pytest
from lossless_sampling import NUM_SAMPLES, PROMPT, SIGNIFICANCE, goodness_of_fit_p_values

from megatron_tlt.formats.architecture import architecture_from_dict
from megatron_tlt.launcher import run_on_ranks
from tiny_models import TINY_LLAMA_ROLLOUT, next_token_fixture

K = 3
PROMPTS = [[i, i + 1] for i in range(1, 9)]


class _StepCounter:
    """A clock that moves one unit per engine step: a reward becomes tokens per step, the same on any machine."""

    def __init__(self):
        self.steps = 0

    def __call__(self) -> float:
        self.steps += 1
        return float(self.steps)


class _DepthCostClock:
    """A clock on which an engine step at depth k takes 1 + k / 2 units (deep drafts cost more), read from the
    scheduler's log of the step that just ended: the goodput model's step-cost fit is then exact."""

    def __init__(self, scheduler):
        self.scheduler, self.now = scheduler, 0.0

    def __call__(self) -> float:
        log = self.scheduler.step_log
        self.now += 1.0 + (log[-1][1] / 2 if log else 0.0)
        return self.now


def _adaptive_engine_on_rank(workdir: str):
    from megatron_tlt.commands.bench_rollout import bench_module
    from megatron_tlt.config import SpeculationConfig
    from megatron_tlt.parallel import ParallelLayout
    from megatron_tlt.spec.adaptive_scheduler import depth_policy_for
    from megatron_tlt.spec.engine import RolloutEngine, RolloutEngineConfig, SamplingSettings, SpeculativeSettings

    arch = architecture_from_dict(TINY_LLAMA_ROLLOUT)
    fixture = next_token_fixture(arch)
    bandit = SpeculationConfig(adaptive=True, bucket_bounds=[1, 2, 4, 8], depths=[0, 1, 2, 3], window=10, epsilon=0.1)
    greedy = SamplingSettings(temperature=0.0, max_tokens=96)
    out = {}
    with ParallelLayout():
        engine = RolloutEngine(arch, RolloutEngineConfig(max_model_len=256, seed=0), workdir=workdir, rank=0,
                               speculative=SpeculativeSettings(num_speculative_tokens=K, adaptive=bandit, seed=0),
                               drafter=fixture["good_drafter"])
        try:
            scheduler = engine.adaptive_scheduler()
            scheduler.clock = _StepCounter()
            engine.load_weights(fixture["target"].items())
            good = engine.generate(PROMPTS, greedy)
            out["learning_depths"] = good.step_depths
            good = engine.generate(PROMPTS, greedy)  # the bandit carries what it learned into the next rollout
            out["good_depths"], out["good_batches"] = good.step_depths, good.step_batch_sizes
            out["good_seconds"], out["good_estimate"] = good.step_seconds, good.speedup_estimate
            out["greedy"] = [r[0] for r in good.token_ids]
            out["good_summary"] = engine.bandit_summary()
            saved = engine.bandit_state()
            scheduler.pin_depth(1)
            pinned = engine.generate(PROMPTS, greedy)
            out["pinned_depths"], out["pinned_drafts"] = pinned.step_depths, pinned.step_drafts
            out["pinned_accepted"] = pinned.spec.num_accepted_tokens
            scheduler.pin_depth(None)
            bandit_in_charge = scheduler.bandit
            scheduler.bandit = bench_module("rollout_bench").TableDepths([(1, 3, 3), (4, 6, 0), (7, 256, 2)], scheduler)
            out["table_steps"], out["table_greedy"] = [], []
            for count in (7, 5, 2):  # a batch size in each range of the table
                tabled = engine.generate(PROMPTS[:count], greedy)
                out["table_steps"] += list(zip(tabled.step_batch_sizes, tabled.step_depths))
                out["table_greedy"].append([r[0] for r in tabled.token_ids])
            scheduler.bandit = bandit_in_charge
            out["table_summary_unchanged"] = engine.bandit_summary() == out["good_summary"]
            out["samples"] = np.array(engine.generate(
                [PROMPT], SamplingSettings(n=NUM_SAMPLES, temperature=1.0, max_tokens=4)).token_ids[0])
            engine.load_drafter(fixture["bad_drafter"])
            # each stale arm is exploited until half its window holds the bad drafter's rewards
            for _ in range(3):
                bad = engine.generate(PROMPTS, greedy)
            out["bad_depths"] = bad.step_depths
            out["greedy_bad_drafter"] = [r[0] for r in bad.token_ids]
            out["bad_summary"] = engine.bandit_summary()
            engine.load_bandit_state(saved)
            out["restored_summary"] = engine.bandit_summary()
            _goodput_on_the_same_engine(engine, fixture, depth_policy_for(
                dataclasses.replace(bandit, policy="goodput", epsilon=0.0, window=300), K), greedy, out)
        finally:
            engine.close()
    return out


def _goodput_on_the_same_engine(engine, fixture, goodput, greedy, out) -> None:
    """The goodput model in charge of the same engine, on a clock where depth costs time."""
    scheduler = engine.adaptive_scheduler()
    engine.load_drafter(fixture["good_drafter"])
    scheduler.bandit = goodput  # the policy in charge of the scheduler's depths
    scheduler.clock = _DepthCostClock(scheduler)
    out["goodput_learning_depths"] = engine.generate(PROMPTS, greedy).step_depths  # tries every depth first
    good = engine.generate(PROMPTS, greedy)
    out["goodput_good_depths"], out["goodput_greedy"] = good.step_depths, [r[0] for r in good.token_ids]
    out["goodput_good_summary"] = engine.bandit_summary()
    engine.load_drafter(fixture["bad_drafter"])
    for _ in range(3):  # the engine-wide acceptance forgets the good drafter's drafts step by step
        bad = engine.generate(PROMPTS, greedy)
    out["goodput_bad_depths"], out["goodput_bad_summary"] = bad.step_depths, engine.bandit_summary()


@pytest.fixture(scope="module")
def adaptive(tmp_path_factory):
    return run_on_ranks(_adaptive_engine_on_rank, 1, str(tmp_path_factory.mktemp("adaptive")), isolated=True)[0]


@pytest.fixture(scope="module")
def exact():
    return next_token_fixture(architecture_from_dict(TINY_LLAMA_ROLLOUT))["next_probs"]


def _estimates(summary: dict) -> dict[int, float]:
    return {int(depth): value for depth, value in summary["estimates"].items() if value is not None}


def test_untried_depths_run_first_in_turn_and_every_step_reports_its_depth(adaptive):
    learning = adaptive["learning_depths"]
    # untried arms first, in turn, until each has min_observations (3) clean rewards: a step is clean when it
    # verifies drafts of its own depth, so a change of depth runs two steps before it is credited
    visits = [k for i, k in enumerate(learning) if i == 0 or learning[i - 1] != k]
    assert visits[:12] == [0, 1, 2, 3] * 3, learning
    assert all(learning.count(k) >= 6 for k in (0, 1, 2)), learning
    assert len(adaptive["good_depths"]) == len(adaptive["good_batches"]) > 10
    summary = adaptive["good_summary"]["5-8"]
    assert summary["best"] == max(_estimates(summary), key=_estimates(summary).get), summary


def test_rewards_are_credited_to_the_depth_that_earned_them(adaptive):
    """Which depth wins on wall-clock time is a benchmark's business (``tlt bench rollout``); a test holds the
    mechanism. On the step-counting clock a reward is the tokens one step made for the batch of 8: with the
    drafter that is always right a depth-k step makes k + 1 per sequence, with the one that is never right 1,
    so every estimate is exact, and the bandit's choice follows its own estimates (ties to the shallowest)."""
    batch = len(PROMPTS)
    good, bad = _estimates(adaptive["good_summary"]["5-8"]), _estimates(adaptive["bad_summary"]["5-8"])
    assert good == {k: batch * (k + 1.0) for k in range(K + 1)}, good
    assert bad == {k: batch * 1.0 for k in range(K + 1)}, bad
    assert adaptive["good_summary"]["5-8"]["best"] == K
    assert adaptive["bad_summary"]["5-8"]["best"] == 0


def test_the_rollouts_speedup_estimate_weighs_each_step_by_its_depths_rate_over_depth_zeros(adaptive):
    """On the step-counting clock a depth-k step makes k + 1 tokens per sequence where depth 0 makes 1, so a step
    that ran t seconds stands for t (k + 1) seconds at depth 0 (``spec/speedup_estimate.py``)."""
    depths, seconds = adaptive["good_depths"], adaptive["good_seconds"]
    assert len(depths) == len(seconds)
    expected = sum(t * (k + 1) for k, t in zip(depths, seconds)) / sum(seconds)
    assert adaptive["good_estimate"] == pytest.approx(expected)
    assert 1.0 < adaptive["good_estimate"] <= K + 1


def test_greedy_output_is_the_same_whatever_depth_each_step_ran(adaptive, exact):
    for prompt, tokens in zip(PROMPTS, adaptive["greedy"]):
        chain, current = [], prompt[-1]
        for _ in range(96):
            current = int(exact[current].argmax())
            chain.append(current)
        assert tokens == chain
    assert adaptive["greedy_bad_drafter"] == adaptive["greedy"]


def test_sampling_with_per_step_depths_matches_the_targets_distribution(adaptive, exact):
    p_values = goodness_of_fit_p_values(adaptive["samples"], exact)
    assert min(p_values) > SIGNIFICANCE, p_values


def test_a_pinned_depth_runs_every_step_at_it_and_reports_each_requests_accepted_drafts(adaptive):
    assert set(adaptive["pinned_depths"]) == {1}
    drafts = adaptive["pinned_drafts"]
    assert len(drafts) == len(adaptive["pinned_depths"])  # one entry per engine step
    outcomes = [accepted for step in drafts for _, accepted in step]
    assert outcomes.count(1) > 0.9 * len(outcomes)  # the exact drafter's one draft is accepted
    # as vLLM's own counters count them, but for the step that reaches max_tokens, which keeps only the tokens
    # the response still had room for (vLLM counts the draft accepted): one at most per request
    assert 0 <= adaptive["pinned_accepted"] - sum(outcomes) <= len(PROMPTS)
    assert len({request for step in drafts for request, _ in step}) == len(PROMPTS)


def test_the_benchs_vllm_table_runs_each_step_at_the_depth_of_its_batch_size_and_teaches_the_bandit_nothing(adaptive):
    """vLLM's static per-batch-size depths, the adaptive policies' rival in ``tlt bench rollout``, in charge of the
    scheduler as a depth policy (``bench/rollout_bench.py``'s ``TableDepths``)."""
    steps = adaptive["table_steps"]
    assert {b for b, _ in steps} == {7, 5, 2}, steps
    for batch, depth in steps:
        assert depth == (3 if batch <= 3 else 0 if batch <= 6 else 2), steps
    for count, greedy in zip((7, 5, 2), adaptive["table_greedy"]):  # lossless whatever the depth
        assert greedy == adaptive["greedy"][:count]
    assert adaptive["table_summary_unchanged"]


def test_bandit_state_saved_and_loaded_restores_what_it_had_learned(adaptive):
    assert adaptive["restored_summary"] == adaptive["good_summary"]
    assert adaptive["restored_summary"] != adaptive["bad_summary"]


def test_goodput_runs_the_depth_of_the_most_tokens_per_unit_of_time(adaptive):
    """On the depth-cost clock a depth-k step takes 1 + k/2 units: with the drafter that is always right it makes
    k + 1 tokens per sequence (k = 3 is best: 4 / 2.5), with the one that is never right 1 (k = 0 is best). The
    model learns both from the requests' drafts and the fitted cost, and the output stays the target's."""
    learning = adaptive["goodput_learning_depths"]
    assert set(learning) == {0, 1, 2, 3}, learning  # each depth measured before the fit is trusted
    good = adaptive["goodput_good_depths"]
    assert good.count(K) >= len(good) - 2, good  # the step that prefills may run another depth
    assert adaptive["goodput_good_summary"]["5-8"]["best"] == K
    assert adaptive["goodput_greedy"] == adaptive["greedy"]
    # New requests start from the engine-wide acceptance (its deep positions still remember the good drafter:
    # the bad one's drafts never reach them); their own first drafts take them to k = 0 within a few steps.
    bad = adaptive["goodput_bad_depths"]
    assert bad[0] > 0 and set(bad[6:]) == {0}, bad
