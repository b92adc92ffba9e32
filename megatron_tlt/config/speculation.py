"""BEG-MAB's settings: which speculation depth each engine step runs."""

from __future__ import annotations

import dataclasses
from typing import Literal

from megatron_tlt.config.checks import ConfigError, _require_increasing, check_choices


@dataclasses.dataclass(kw_only=True)
class SpeculationConfig:
    """BEG-MAB: each rollout engine picks the speculation depth of every step from its live batch size.

    The bandit (``spec/bandit.py``) takes this section as its settings; its own values are checked here,
    whether BEG-MAB is on or not, and the deepest arm against the engine's depth by ``arms``."""

    adaptive: bool = False
    """Let the bandit choose the depth per engine step, up to drafter.depth (moot when that is 0)."""
    policy: Literal["bandit", "goodput"] = "bandit"
    """What chooses each step's depth when ``adaptive``: ``bandit`` (BEG-MAB, TLT's: a reward window per
    batch-size bucket and depth) or ``goodput`` (``spec/goodput.py``: the live requests' own acceptance and a
    fitted step-cost model; the epsilon, window and min_observations below serve it too)."""
    bucket_bounds: list[int] = dataclasses.field(default_factory=lambda: [1, 2, 5, 21, 32])
    """Inclusive upper batch-size bounds of the buckets (TLT's: 1, 2, 3-5, 6-21, 22-32, then 33+)."""
    depths: list[int] | None = None
    """The arms (depths K, 0 = off); null: every depth 0..drafter.depth, written into the run's config.yaml."""
    epsilon: float = 0.1
    """Share of steps that explore a random depth."""
    exploration: Literal["uniform", "neighbours"] = "uniform"
    """Which depth BEG-MAB explores: ``uniform`` (TLT's: any arm) or ``neighbours`` (an arm next to the best of
    the bucket): where the best depths lie close together, a uniform pick spends steps at depths far from them.
    The goodput model always explores neighbours."""
    window: int = 300
    """Rewards kept per bucket and depth (a sliding window: the drafter changes)."""
    median_blocks: int = 5
    """The estimate is the median of the means of this many consecutive blocks of the window: robust to
    outlying steps, and unlike the median of single rewards (``window``), true to the throughput at small
    batches, where a step's reward takes only a few values."""
    min_observations: int = 3
    """Rewards each depth of a bucket gets before the greedy choice may pass it over (untried arms come first)."""
    draft_sampling: Literal["probabilistic", "greedy"] = "probabilistic"
    """How the drafter proposes while the rollout samples (temperature > 0), adaptive or not:
    ``probabilistic`` draws each draft token from the drafter's distribution q and verification accepts it with
    min(1, p/q) (accepted share sum_v min(p, q)); ``greedy`` proposes q's argmax, accepted with the target's
    probability p of it. Both are lossless, and greedy decoding proposes the argmax either way."""
    max_speculative_batch: int | None = None
    """Batches above this never speculate and get no speculative CUDA graphs (TLT uses 32 on H100s); null: the
    bandit decides at every batch size."""
    min_ceiling: float = 1.1
    """A new run speculates only with a drafter whose ceiling (``spec/ceiling.py``: what speculation buys at most,
    verifying free) reaches this, judged on the starting drafter's held-out acceptance (its cold start's); below
    it the engines roll out without drafts while the drafter still trains on idle ranks
    (``commands/speculation_gate.py``). A speculating vLLM engine runs its drafter at every step, depth 0 too; 0
    serves any drafter."""

    def __post_init__(self) -> None:
        self._check_buckets()
        self._check_depths()
        check_choices(self, "speculation")
        # Written so that NaN fails too: every comparison with NaN is False.
        if not 0.0 <= self.epsilon <= 1.0:
            raise ConfigError(f"speculation.epsilon must be in [0, 1], got {self.epsilon}.")
        if self.window < 1:
            raise ConfigError(f"speculation.window must be >= 1 reward, got {self.window}.")
        if not 1 <= self.median_blocks <= self.window:
            raise ConfigError(f"speculation.median_blocks must be in [1, window={self.window}], got "
                              f"{self.median_blocks}.")
        if not 1 <= self.min_observations <= self.window:
            raise ConfigError(f"speculation.min_observations must be in [1, window={self.window}], got "
                              f"{self.min_observations}.")
        if not self.min_ceiling >= 0.0:
            raise ConfigError(f"speculation.min_ceiling must be >= 0 (0: speculate with any drafter), got "
                              f"{self.min_ceiling}.")
        if self.max_speculative_batch is not None:
            if self.max_speculative_batch < 1:
                raise ConfigError(f"speculation.max_speculative_batch must be >= 1 or None, got "
                                  f"{self.max_speculative_batch}.")
            if self.depths is not None and 0 not in self.depths:
                raise ConfigError(f"speculation.max_speculative_batch needs depth 0 among depths "
                                  f"{tuple(self.depths)} (the depth of batches above it).")

    def _check_buckets(self) -> None:
        bounds = tuple(self.bucket_bounds)
        if not bounds:
            raise ConfigError("speculation.bucket_bounds is empty; give at least one upper batch-size bound.")
        if bounds[0] < 1:
            raise ConfigError(f"speculation.bucket_bounds must be >= 1 (batch sizes start at 1), got {bounds[0]} "
                              f"in {bounds}.")
        _require_increasing("speculation.bucket_bounds", bounds, "the buckets")

    def _check_depths(self) -> None:
        if self.depths is None:  # 0..max_depth: distinct and >= 0 by construction
            return
        depths = tuple(self.depths)
        if not depths:
            raise ConfigError("speculation.depths is empty; give at least one speculation depth K "
                              "(0 = speculation off), or null for every depth up to drafter.depth.")
        duplicates = sorted({k for k in depths if depths.count(k) > 1})
        if duplicates:
            raise ConfigError(f"speculation.depths has duplicate values {duplicates} in {depths}; each arm must "
                              "be distinct.")
        if min(depths) < 0:
            raise ConfigError(f"speculation.depths must be >= 0, got {min(depths)} in {depths}.")

    def arms(self, max_depth: int) -> tuple[int, ...]:
        """The bandit's arms in an engine built for depths up to ``max_depth`` (``drafter.depth``):
        ``depths``, or every depth 0..max_depth when it is None. Refuses a deeper arm: the engine has no
        drafts beyond its depth to propose."""
        depths = tuple(range(max_depth + 1)) if self.depths is None else tuple(self.depths)
        if max(depths) > max_depth:
            raise ConfigError(f"speculation.depths has {max(depths)}, above the engine's maximum speculation depth "
                              f"max_depth={max_depth} (drafter.depth): lower the depths or raise it.")
        return depths
