"""BEG-MAB: the bucketed epsilon-greedy bandit that picks the speculation depth K per batch-size bucket.

Driven like the engine drives it: choose(batch_size) -> run the step -> observe(bucket, K, tokens/s),
with rewards drawn from a synthetic table of mean tokens/s plus seeded Gaussian noise.
"""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest

from megatron_tlt.config import ConfigError, SpeculationConfig
from megatron_tlt.spec.bandit import BanditConfigError, BucketedEpsilonGreedy

MAX_DEPTH = 5
DEPTHS = (0, 1, 2, 3)

# Mean tokens/s per bucket (default bounds: 1, 2, 3-5, 6-21, 22-32, 33+) and depth K. Deep speculation
# wins at batch 1, no speculation wins at large batches; the best arm is >= 10% above the runner-up.
TABLE = {
    0: {0: 100, 1: 150, 2: 180, 3: 200},
    1: {0: 200, 1: 290, 2: 340, 3: 300},
    2: {0: 450, 1: 640, 2: 560, 3: 500},
    3: {0: 1500, 1: 1800, 2: 1600, 3: 1400},
    4: {0: 2600, 1: 2300, 2: 2000, 3: 1800},
    5: {0: 3200, 1: 2800, 2: 2400, 3: 2000},
}
NOISE = 0.05  # relative standard deviation of a step's tokens/s


def argmax(row: dict[int, float]) -> int:
    return max(row, key=row.__getitem__)


def batch_size_in(bandit: BucketedEpsilonGreedy, bucket: int, rng: random.Random) -> int:
    bounds = bandit.settings.bucket_bounds
    lo = bounds[bucket - 1] + 1 if bucket else 1
    hi = bounds[bucket] if bucket < len(bounds) else lo + 31
    return rng.randint(lo, hi)


def step(bandit: BucketedEpsilonGreedy, table: dict, rng: random.Random, bucket: int) -> int:
    """One engine step in `bucket`: choose K, 'run' it, report a noisy reward. Returns K."""
    batch_size = batch_size_in(bandit, bucket, rng)
    assert bandit.bucket_of(batch_size) == bucket
    depth = bandit.choose(batch_size)
    mean = table[bucket][depth]
    bandit.observe(bucket, depth, rng.gauss(mean, NOISE * mean))
    return depth


def make(*, seed: int = 0, **kwargs) -> BucketedEpsilonGreedy:
    """A bandit over DEPTHS (unless given) in an engine built for MAX_DEPTH; kwargs are speculation.* keys."""
    return BucketedEpsilonGreedy(SpeculationConfig(**{"depths": list(DEPTHS), **kwargs}), max_depth=MAX_DEPTH,
                                 seed=seed)


def test_converges_to_the_best_arm_of_every_bucket():
    bandit, rng = make(epsilon=0.1, seed=1), random.Random(2)
    chosen: dict[int, list[int]] = {b: [] for b in TABLE}
    for _ in range(2000):
        bucket = rng.randrange(bandit.num_buckets)
        chosen[bucket].append(step(bandit, TABLE, rng, bucket))

    for bucket, row in TABLE.items():
        assert bandit.best_depth(bucket) == argmax(row), bandit.summary()
        # After the warm-up (one pull per arm) epsilon=0.1 over 4 arms leaves 1 - 0.1 * 3/4 = 92.5%
        # of pulls on the best arm once it is found; > 85% means it was found almost at once.
        after_warmup = chosen[bucket][len(DEPTHS):]
        share = after_warmup.count(argmax(row)) / len(after_warmup)
        assert share > 0.85, (bandit.bucket_label(bucket), share)
    assert bandit.best_depth(0) == 3 and bandit.best_depth(5) == 0

    summary = json.loads(json.dumps(bandit.summary()))
    assert list(summary) == ["1", "2", "3-5", "6-21", "22-32", "33+"]
    assert summary["1"]["best"] == 3
    assert sum(summary["1"]["pulls"].values()) == len(chosen[0])
    assert summary["33+"]["estimates"]["0"] == pytest.approx(3200, rel=0.02)


def run_fixed(epsilon: float, choices: int = 5000) -> list[int]:
    """`choices` steps in bucket 0 after the warm-up, with noiseless rewards (best arm K=3)."""
    bandit, rng = make(epsilon=epsilon, seed=3), random.Random(4)
    for _ in range(len(DEPTHS) * bandit.settings.min_observations):
        step(bandit, TABLE, rng, 0)
    table = {0: TABLE[0]}
    picks = []
    for _ in range(choices):
        depth = bandit.choose(1)
        bandit.observe(0, depth, table[0][depth])
        picks.append(depth)
    return picks


def test_explores_at_rate_epsilon():
    picks = run_fixed(epsilon=0.2)
    # Exploration picks uniformly among all 4 arms, so 3 in 4 explorations miss the best arm:
    # expected 0.2 * 3/4 = 0.15. Binomial sd over 5000 choices: sqrt(0.15 * 0.85 / 5000) = 0.005,
    # so +-0.02 is 4 sd (and the seed is fixed, so the test is deterministic anyway).
    off_best = sum(k != 3 for k in picks) / len(picks)
    assert off_best == pytest.approx(0.2 * 3 / 4, abs=0.02)


def test_epsilon_zero_never_explores_and_one_is_uniform():
    assert set(run_fixed(epsilon=0.0)) == {3}
    picks = run_fixed(epsilon=1.0)
    # Uniform: 1250 per arm, sd sqrt(5000 * 1/4 * 3/4) = 31 picks = 0.006; +-0.025 is 4 sd.
    for k in DEPTHS:
        assert picks.count(k) / len(picks) == pytest.approx(0.25, abs=0.025)


def test_neighbour_exploration_measures_only_the_depths_next_to_the_best():
    bandit = make(depths=(0, 1, 2, 3, 4, 5), epsilon=0.2, exploration="neighbours", seed=6)
    rewards = {0: 100, 1: 150, 2: 180, 3: 200, 4: 190, 5: 170}  # best K=3
    picks = []
    for _ in range(3000):
        depth = bandit.choose(1)
        bandit.observe(0, depth, rewards[depth])
        picks.append(depth)
    explored = picks[6 * 3:]  # after each arm's three forced measurements
    assert set(explored) == {2, 3, 4}
    # half the explorations (0.2 of steps) go either side of the best
    assert explored.count(2) / len(explored) == pytest.approx(0.1, abs=0.02)
    assert explored.count(4) / len(explored) == pytest.approx(0.1, abs=0.02)
    # at the edge of the arms the only neighbour is explored (the other side is the best itself)
    edge = make(depths=(0, 1, 2), epsilon=1.0, exploration="neighbours", seed=7)
    for _ in range(9):
        depth = edge.choose(1)
        edge.observe(0, depth, {0: 10, 1: 20, 2: 30}[depth])
    assert {edge.choose(1) for _ in range(50)} == {1, 2}
    with pytest.raises(ConfigError, match="speculation.exploration must be one of uniform, neighbours, got 'greedy'"):
        SpeculationConfig(exploration="greedy")


def test_untried_arms_come_first_in_turn_in_depths_order():
    bandit, rng = make(epsilon=1.0, min_observations=1), random.Random(5)
    assert [step(bandit, TABLE, rng, 0) for _ in DEPTHS] == list(DEPTHS)
    # Buckets are independent: a fresh bucket starts its own warm-up, even at epsilon=1.
    assert [step(bandit, TABLE, rng, 5) for _ in DEPTHS] == list(DEPTHS)
    # An arm counts as tried once it has min_observations rewards (3 by default), measured in turn: one
    # pass over the arms, then the next, so that each arm meets the batch sizes of the whole bucket
    default = make(epsilon=1.0)
    assert [step(default, TABLE, rng, 0) for _ in range(3 * len(DEPTHS))] == [k for _ in range(3) for k in DEPTHS]

    custom = make(depths=(3, 0, 2), min_observations=1)
    order = []
    for _ in range(3):
        depth = custom.choose(1)
        custom.observe(0, depth, 10.0)
        order.append(depth)
    assert order == [3, 0, 2]

    # "Untried" means never observed: an arm chosen but not yet rewarded is chosen again.
    fresh = make()
    assert [fresh.choose(40) for _ in range(3)] == [0, 0, 0]
    assert fresh.summary()["33+"]["pulls"] == {"0": 3, "1": 0, "2": 0, "3": 0}
    assert fresh.best_depth(5) is None and fresh.estimate(5, 0) is None


# Bucket 0 with a strong drafter (deepest speculation wins) and a weak one (no speculation wins).
STRONG_DRAFTER = {0: {0: 100, 1: 150, 2: 180, 3: 200}}
WEAK_DRAFTER = {0: {0: 100, 1: 80, 2: 60, 3: 40}}


def steps_until_best(bandit: BucketedEpsilonGreedy, table: dict, rng: random.Random, depth: int, limit: int) -> int:
    """Steps in bucket 0 until `depth` is the best estimate (at most `limit`); returns the steps taken."""
    for n in range(1, limit + 1):
        step(bandit, table, rng, 0)
        if bandit.best_depth(0) == depth:
            break
    return n


def test_adapts_when_the_drafter_collapses():
    window = 50
    bandit, rng = make(epsilon=0.1, window=window, seed=6), random.Random(7)
    for _ in range(500):
        step(bandit, STRONG_DRAFTER, rng, 0)
    assert bandit.best_depth(0) == 3

    # The drafter collapses: deeper speculation now costs throughput; K=0 is untouched by the drafter.
    # The exploited arm refills its window first and each stale arm in turn gets exploited and
    # overwritten, about window/2 + 1 observations each, so a few half-windows bound the switch.
    n = steps_until_best(bandit, WEAK_DRAFTER, rng, depth=0, limit=3 * window)
    assert bandit.best_depth(0) == 0, bandit.summary()
    assert n <= 3 * window
    # And it stays switched: the new best is exploited from then on.
    assert [step(bandit, WEAK_DRAFTER, rng, 0) for _ in range(200)].count(0) > 0.85 * 200


def test_adapts_when_an_unexploited_arm_improves_through_exploration_only():
    # The slow direction: the exploited arm stays as it was, stale arms get better. Only exploration
    # refreshes them, at epsilon / n_arms = 2.5% of steps per arm; a full stale window flips after
    # window/2 + 1 = 26 fresh rewards, so about 26 / 0.025 = 1040 steps in the worst case (less here:
    # the weak arms hold only the few rewards exploration gave them). Hence a short window next to an
    # RL step's length of engine steps; 2000 leaves room for the exploration noise.
    window = 50
    bandit, rng = make(epsilon=0.1, window=window, seed=8), random.Random(9)
    for _ in range(300):
        step(bandit, WEAK_DRAFTER, rng, 0)
    assert bandit.best_depth(0) == 0

    n = steps_until_best(bandit, STRONG_DRAFTER, rng, depth=3, limit=2000)
    assert bandit.best_depth(0) == 3
    assert n <= 2000


def test_median_ignores_an_outlier_and_non_finite_rewards():
    bandit = make()
    for _ in range(10):
        for k, reward in {0: 100.0, 1: 150.0, 2: 180.0, 3: 170.0}.items():
            bandit.observe(0, k, reward)
    bandit.observe(0, 0, 1e9)  # one step timed at ~0 s
    assert statistics.mean([100.0] * 10 + [1e9]) > 180.0  # a mean would now pick K=0 ...
    assert bandit.best_depth(0) == 2  # ... the median does not
    assert bandit.estimate(0, 0) == 100.0

    for bad in (math.inf, -math.inf, math.nan):
        bandit.observe(0, 1, bad)
    assert bandit.estimate(0, 1) == 150.0
    assert bandit.summary()["1"]["estimates"]["1"] == 150.0


# Batch 1 as measured on the tiny default: a step yields 1..K+1 tokens. K=1 (7.6 ms a step) accepts its
# draft 3 times in 5; K=2 (8.7 ms) yields 1, 2, 2, 3, 3 tokens. K=2 makes more tokens per second (253 vs
# 211), but a step's typical count is 2 for both, so the median of single rewards ranks K=1 first.
QUANTISED_REWARDS = {1: [2 / 0.0076, 2 / 0.0076, 2 / 0.0076, 1 / 0.0076, 1 / 0.0076],
                     2: [1 / 0.0087, 2 / 0.0087, 2 / 0.0087, 3 / 0.0087, 3 / 0.0087]}


def test_the_estimate_follows_the_throughput_where_rewards_take_few_values():
    default, plain_median = make(depths=(1, 2)), make(depths=(1, 2), median_blocks=300)
    for _ in range(20):  # 100 rewards per arm, the counts interleaved in time
        for depth, rewards in QUANTISED_REWARDS.items():
            for reward in rewards:
                default.observe(0, depth, reward)
                plain_median.observe(0, depth, reward)
    assert default.estimate(0, 2) == pytest.approx(statistics.fmean(QUANTISED_REWARDS[2]))
    assert default.estimate(0, 1) == pytest.approx(statistics.fmean(QUANTISED_REWARDS[1]))
    assert default.best_depth(0) == 2
    assert plain_median.estimate(0, 1) == pytest.approx(2 / 0.0076)
    assert plain_median.best_depth(0) == 1


def test_block_means_shrug_off_outliers_in_a_minority_of_blocks():
    bandit = make(median_blocks=5)
    for i in range(100):
        bandit.observe(0, 2, 1e6 if i in (3, 47) else 200.0)  # two steps timed at ~0 s, in two of 5 blocks
    assert bandit.estimate(0, 2) == 200.0
    few = make(median_blocks=5)
    for reward in (100.0, 300.0):  # fewer rewards than blocks: one block each
        few.observe(0, 2, reward)
    assert few.estimate(0, 2) == 200.0


def test_observe_and_estimate_refuse_unknown_arms_and_buckets():
    bandit = make()
    with pytest.raises(ValueError, match="depth 4 is not one of the arms"):
        bandit.observe(0, 4, 1.0)
    with pytest.raises(ValueError, match="bucket must be in"):
        bandit.observe(6, 0, 1.0)
    with pytest.raises(ValueError, match="bucket must be in"):
        bandit.estimate(-1, 0)


def test_state_dict_round_trip_through_json_continues_identically():
    settings = dict(epsilon=0.3, window=20, seed=10)
    original, rng = make(**settings), random.Random(11)
    for _ in range(300):
        step(original, TABLE, rng, rng.randrange(original.num_buckets))

    restored = make(**{**settings, "seed": 999})  # the loaded RNG state overrides the seed
    restored.load_state_dict(json.loads(json.dumps(original.state_dict())))
    assert restored.summary() == original.summary()

    # Same reward stream for both: every subsequent choice must agree.
    rng_a, rng_b = random.Random(12), random.Random(12)
    for _ in range(300):
        bucket = rng_a.randrange(original.num_buckets)
        assert rng_b.randrange(restored.num_buckets) == bucket
        assert step(original, TABLE, rng_a, bucket) == step(restored, TABLE, rng_b, bucket)
    assert restored.summary() == original.summary()
    saved, again = json.loads(json.dumps(original.state_dict())), restored.state_dict()
    assert {k: v for k, v in again.items() if k != "settings"} == {k: v for k, v in saved.items() if k != "settings"}


def test_loading_state_with_other_arms_or_buckets_is_refused():
    state = make().state_dict()
    with pytest.raises(BanditConfigError, match="depths"):
        make(depths=(0, 1, 2)).load_state_dict(state)
    with pytest.raises(BanditConfigError, match="bucket_bounds"):
        make(bucket_bounds=(1, 4, 16)).load_state_dict(state)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"bucket_bounds": ()}, "bucket_bounds is empty"),
    ({"bucket_bounds": (0, 4)}, "bucket_bounds must be >= 1"),
    ({"bucket_bounds": (1, 5, 5)}, "got 5 then 5 .* would overlap"),
    ({"bucket_bounds": (4, 2)}, "got 4 then 2 .* would overlap"),
    ({"depths": ()}, "depths is empty"),
    ({"depths": (0, 1, 1)}, r"duplicate values \[1\]"),
    ({"depths": (-1, 0)}, "depths must be >= 0, got -1"),
    ({"depths": (0, 6)}, "above the engine's maximum .* max_depth=5"),
    ({"epsilon": -0.1}, r"epsilon must be in \[0, 1\], got -0.1"),
    ({"epsilon": 1.5}, r"epsilon must be in \[0, 1\], got 1.5"),
    ({"epsilon": math.nan}, r"epsilon must be in \[0, 1\], got nan"),
    ({"window": 0}, "window must be >= 1"),
    ({"window": 10, "median_blocks": 11}, r"median_blocks must be in \[1, window=10\], got 11"),
    ({"median_blocks": 0}, r"median_blocks must be in \[1, window=300\], got 0"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        make(**kwargs)


def test_bucket_mapping_and_labels():
    bandit = make()
    cases = {1: "1", 2: "2", 3: "3-5", 5: "3-5", 6: "6-21", 21: "6-21", 22: "22-32", 32: "22-32", 33: "33+", 4096: "33+"}
    for batch_size, label in cases.items():
        assert bandit.bucket_label(bandit.bucket_of(batch_size)) == label
    assert bandit.num_buckets == 6
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        bandit.bucket_of(0)


def test_batches_above_max_speculative_batch_never_speculate():
    bandit = make(max_speculative_batch=32, epsilon=1.0)
    assert {bandit.choose(b) for b in (33, 64, 200) for _ in range(50)} == {0}
    chosen = set()
    for _ in range(200):  # at the limit the bandit still decides
        depth = bandit.choose(32)
        bandit.observe(bandit.bucket_of(32), depth, 100.0)
        chosen.add(depth)
    assert chosen == set(DEPTHS)
    with pytest.raises(ConfigError, match="needs depth 0"):
        SpeculationConfig(depths=[1, 2], max_speculative_batch=32)
    with pytest.raises(ConfigError, match="max_speculative_batch must be >= 1"):
        SpeculationConfig(max_speculative_batch=0)


def test_without_depths_the_arms_are_every_depth_the_engine_is_built_for():
    bandit = BucketedEpsilonGreedy(SpeculationConfig(), max_depth=3)
    assert bandit.summary()["1"]["pulls"] == {"0": 0, "1": 0, "2": 0, "3": 0}
    assert bandit.state_dict()["settings"]["depths"] == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="speculation.depths has 4, above .* max_depth=3"):
        BucketedEpsilonGreedy(SpeculationConfig(depths=[0, 4]), max_depth=3)


# ---------------------------------------------------------------- states saved by earlier versions

def _old_state(bandit: BucketedEpsilonGreedy, version: int, context_bucket_bounds=()) -> dict:
    """``bandit``'s state as an earlier bandit wrote it: version 2 beside the windows of credit "shallower"
    (yields, paces), version 3 also with each batch bucket's arms under its one context bucket."""
    state = bandit.state_dict()
    old = {**state, "version": version, "settings": {**state["settings"], "credit": "shallower"}}
    old["yields"] = [[[1.0] for _ in arms] for arms in state["rewards"]]
    old["paces"] = [[[2.0] for _ in arms] for arms in state["rewards"]]
    if version == 3:
        old["settings"]["context_bucket_bounds"] = list(context_bucket_bounds)
        for key in ("rewards", "yields", "paces", "pulls"):
            old[key] = [[arms] for arms in old[key]]
    return json.loads(json.dumps(old))


@pytest.mark.parametrize("version", [2, 3])
def test_a_state_saved_by_an_earlier_version_loads_its_rewards_and_continues_identically(version):
    before, rng = make(epsilon=0.3, seed=3), random.Random(4)
    for _ in range(300):
        step(before, TABLE, rng, rng.randrange(before.num_buckets))
    after = make(epsilon=0.3, seed=99)
    after.load_state_dict(_old_state(before, version))
    # the windows of credit "shallower" are not read: every estimate is its rewards', as before
    assert after.summary() == before.summary()
    assert without_settings(after.state_dict()) == without_settings(before.state_dict())
    rng_a, rng_b = random.Random(5), random.Random(5)
    for _ in range(200):
        bucket = rng_a.randrange(6)
        assert rng_b.randrange(6) == bucket
        assert step(before, TABLE, rng_a, bucket) == step(after, TABLE, rng_b, bucket)


def without_settings(state: dict) -> dict:
    return {k: v for k, v in state.items() if k != "settings"}  # the seed given at construction differs


def test_a_state_saved_with_context_buckets_is_refused():
    """speculation.context_bucket_bounds is gone: each cell of such a state holds only some context lengths."""
    with pytest.raises(BanditConfigError, match=r"saved context_bucket_bounds \(256, 512\): the state was saved "
                                                r"with context buckets, an option since removed"):
        make().load_state_dict(_old_state(make(), 3, context_bucket_bounds=[256, 512]))
