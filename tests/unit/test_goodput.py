"""The goodput depth model: depths from per-position acceptance, per-request acceptance and a fitted step cost.

Driven as the scheduler drives it (choose -> every request's drafts -> the step's time), with a synthetic engine:
known acceptance per draft position, a known linear step cost and seeded noise, so every expectation is exact.
"""

from __future__ import annotations

import json
import random

import pytest

from megatron_tlt.config import ConfigError, SpeculationConfig
from megatron_tlt.spec.adaptive_scheduler import depth_policy_for
from megatron_tlt.spec.bandit import BanditConfigError, BucketedEpsilonGreedy
from megatron_tlt.spec.goodput import GoodputDepthModel

DEPTHS = (0, 1, 2, 3, 4, 6)
ACCEPTANCE = (0.9, 0.85, 0.8, 0.7, 0.6, 0.5)  # per draft position: deep drafts are harder


def step_cost(batch: int, depth: int) -> float:
    return 0.002 + 0.00005 * batch + 0.0006 * depth + 0.00001 * batch * depth


def expected_tokens(depth: int, scale: float = 1.0) -> float:
    tokens, reached = 1.0, 1.0
    for k in range(depth):
        reached *= min(1.0, scale * ACCEPTANCE[k])
        tokens += reached
    return tokens


def true_best(batch: int, scale: float = 1.0) -> int:
    return max(DEPTHS, key=lambda k: (expected_tokens(k, scale) * batch / step_cost(batch, k), -k))


def make(seed: int = 0, **kwargs) -> GoodputDepthModel:
    return GoodputDepthModel(SpeculationConfig(adaptive=True, policy="goodput", depths=list(DEPTHS), **kwargs),
                             max_depth=max(DEPTHS), seed=seed)


def drive(model: GoodputDepthModel, steps: int, rng: random.Random, batches=(1, 64), scales=None) -> list[int]:
    """``steps`` engine steps; request r accepts position k with ``scales[r] * ACCEPTANCE[k]``."""
    chosen = []
    for _ in range(steps):
        batch = rng.randint(*batches)
        live = [f"r{i}" for i in range(batch)]
        depth = model.choose(batch, live)
        chosen.append(depth)
        for request in live:
            scale = (scales or {}).get(request, 1.0)
            accepted = 0
            while accepted < depth and rng.random() < min(1.0, scale * ACCEPTANCE[accepted]):
                accepted += 1
            model.observe_drafts(request, depth, accepted)
        model.observe_step(batch, depth, 0, step_cost(batch, depth) * rng.uniform(0.97, 1.03))
    return chosen


def test_learns_the_acceptance_of_every_draft_position():
    model = make(seed=1)
    drive(model, 800, random.Random(2))
    assert model.position_acceptance() == pytest.approx(ACCEPTANCE, abs=0.05)


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_chooses_the_depth_of_the_highest_true_goodput(batch):
    model = make(seed=1)
    drive(model, 800, random.Random(2))
    assert model.best_depth_for(batch, []) == true_best(batch)


def test_the_fitted_step_cost_matches_the_engine_at_the_depths_that_compete():
    # Depths 0 and 1 are far from the best (3): once their first steps leave the window the line extrapolates
    # to them, and only the depths the choice runs between need to be exact.
    model = make(seed=3)
    drive(model, 600, random.Random(4))
    for batch in (1, 16, 64):
        for depth in (2, 3, 4, 6):
            assert model.step_seconds(batch, depth) == pytest.approx(step_cost(batch, depth), rel=0.05)


def test_an_outlying_step_does_not_bend_the_cost_fit():
    model, rng = make(seed=5), random.Random(6)
    drive(model, 300, rng)
    model.observe_step(8, 4, 0, 10.0)  # a weight sync inside a step
    drive(model, 20, rng)  # enough for a refit
    assert model.step_seconds(8, 4) == pytest.approx(step_cost(8, 4), rel=0.05)


def test_the_live_requests_own_acceptance_sets_the_depth():
    # Request "hard" accepts at 0.4x the engine's rate. Alone in the tail, it needs a shallower depth than the
    # engine-wide rates would choose; the model sees that from its own drafts.
    model, rng = make(seed=7, epsilon=0.0), random.Random(8)
    drive(model, 800, rng)
    for _ in range(40):
        depth = model.choose(1, ["hard"])
        accepted = 0
        while accepted < depth and rng.random() < 0.4 * ACCEPTANCE[accepted]:
            accepted += 1
        model.observe_drafts("hard", depth, accepted)
    assert true_best(1, 0.4) < true_best(1)
    assert model.choose(1, ["hard"]) == true_best(1, 0.4)
    assert model.choose(1, ["new"]) == true_best(1)  # an unseen request: the engine's rates
    model.forget_requests_except(["new"])
    assert model.request_acceptance("hard") == 1.0


def test_every_depth_is_tried_first_and_exploration_stays_next_to_the_choice():
    model = make(seed=9, epsilon=0.2, min_observations=2)
    chosen = drive(model, 400, random.Random(10), batches=(64, 64))
    assert chosen[:12] == [d for d in DEPTHS for _ in range(2)]
    best = true_best(64)
    late = chosen[100:]
    assert late.count(best) > 0.7 * len(late)
    neighbours = {DEPTHS[DEPTHS.index(best) - 1], DEPTHS[DEPTHS.index(best) + 1], best}
    # Far depths run only when their last steps leave the window (min_observations steps per window).
    assert sum(d not in neighbours for d in late) <= 0.03 * len(late)


def test_batches_above_the_speculative_limit_never_speculate():
    model = make(seed=11, max_speculative_batch=16)
    drive(model, 200, random.Random(12), batches=(1, 16))
    assert all(model.choose(b, []) == 0 for b in (17, 64))


def test_state_round_trips_through_json_and_refuses_a_bandits():
    model = make(seed=13)
    drive(model, 300, random.Random(14))
    restored = make(seed=0)
    restored.load_state_dict(json.loads(json.dumps(model.state_dict())))
    assert restored.position_acceptance() == pytest.approx(model.position_acceptance())
    for batch in (1, 32):
        assert restored.best_depth_for(batch, []) == model.best_depth_for(batch, [])
    assert [restored.choose(8, []) for _ in range(20)] == [model.choose(8, []) for _ in range(20)]
    bandit = BucketedEpsilonGreedy(SpeculationConfig(adaptive=True, depths=list(DEPTHS)), max_depth=6)
    with pytest.raises(BanditConfigError, match="'bandit'.*'goodput'"):
        restored.load_state_dict(bandit.state_dict())
    with pytest.raises(BanditConfigError, match="'goodput'.*'bandit'"):
        bandit.load_state_dict(model.state_dict())


def test_the_summary_reads_as_the_bandits():
    model = make(seed=15)
    drive(model, 300, random.Random(16))
    summary = json.loads(json.dumps(model.summary()))
    assert list(summary) == ["1", "2", "3-5", "6-21", "22-32", "33+"]
    assert all(entry["best"] in DEPTHS and set(entry["estimates"]) == {str(k) for k in DEPTHS}
               for entry in summary.values())


def test_speculation_policy_names_the_model():
    settings = SpeculationConfig(adaptive=True, policy="goodput", depths=[0, 2])
    assert isinstance(depth_policy_for(settings, 2), GoodputDepthModel)
    assert isinstance(depth_policy_for(SpeculationConfig(adaptive=True), 2), BucketedEpsilonGreedy)
    with pytest.raises(ConfigError, match="speculation.policy must be one of bandit, goodput, got 'ucb'"):
        SpeculationConfig(policy="ucb")


def test_a_window_too_small_to_try_every_depth_is_refused():
    with pytest.raises(BanditConfigError, match=r"window=10 cannot hold min_observations=3 steps of each of the 6"):
        make(window=10)
