"""BEG-MAB: the bucketed epsilon-greedy multi-armed bandit that picks the speculation depth K.

Each engine step the rollout engine asks for a depth K (0 = speculation off) and later reports a
reward: generated tokens per second of that step. Arms are the depths; the best one depends on the
batch size (speculation pays at small batches, where decoding is memory-bound and spare compute
verifies drafts for free, but not at large ones), so every batch-size bucket runs its own bandit, and
a step at depth K credits depth K alone.

An arm's estimate comes from its last `window` rewards; the sliding window forgets old rewards so the
choice follows a drafter that improves, or degrades, with every RL step. The estimate is TLT's
median, taken over the means of `median_blocks` consecutive blocks of the window rather than over
single rewards. Either median shrugs off a noisy step time (a GC pause, a weight sync). But at small
batches a step's reward takes only a few values (batch 1, depth K: 1..K+1 tokens), and the median of
so few values is not the throughput. At batch 1 on the tiny default the plain median said 353
tokens/s for K=2 and 277 for K=1, where their steps made 274 and 221.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
import random
import statistics
from collections.abc import Iterable
from typing import Any

from megatron_tlt.config import ConfigError, SpeculationConfig

_STATE_VERSION = 4
"""2: the windows of credit "shallower"; 3: per context bucket too; 4: both options removed, windows and pulls
indexed [batch bucket][arm] again, as in versions 1 and 2 (``load_state_dict`` reads every version)."""


class BanditConfigError(ConfigError):
    """A bandit that cannot run with these arms or this saved state; the message names the values."""


class BucketedEpsilonGreedy:
    """One epsilon-greedy bandit over the arms of ``settings`` (``speculation.*``) per batch-size bucket.

    ``settings.depths`` None gives the arms 0..``max_depth``, the deepest speculation the engine is built
    for; ``SpeculationConfig`` has checked its own values when it was built, the arms against
    ``max_depth`` are checked here. ``seed`` seeds the bandit's own exploration.
    """

    def __init__(self, settings: SpeculationConfig, *, max_depth: int, seed: int = 0) -> None:
        self.settings = settings
        self.max_depth = max_depth
        self.seed = seed
        self._bounds = tuple(settings.bucket_bounds)
        self._depths = settings.arms(max_depth)
        self._arm = {k: i for i, k in enumerate(self._depths)}
        # Own generator, so the engine's other randomness neither disturbs nor is disturbed by ours.
        self._rng = random.Random(seed)
        # Per bucket, per arm:
        self._rewards = [[self._new_window() for _ in self._depths] for _ in range(self.num_buckets)]
        self._pulls = [[0] * len(self._depths) for _ in range(self.num_buckets)]

    def _new_window(self, values: Iterable[float] = ()) -> collections.deque[float]:
        return collections.deque(values, maxlen=self.settings.window)

    @property
    def num_buckets(self) -> int:
        """Batch-size buckets."""
        return len(self._bounds) + 1

    def bucket_of(self, batch_size: int) -> int:
        """Index of the bucket holding `batch_size` (>= 1)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        # Bounds are inclusive upper ends, so the first bound >= batch_size names the bucket.
        return bisect.bisect_left(self._bounds, batch_size)

    def bucket_label(self, bucket: int) -> str:
        """Human-readable batch-size range of a bucket: "1", "3-5", "33+"."""
        self._check_bucket(bucket)
        if bucket == len(self._bounds):
            return f"{self._bounds[-1] + 1}+"
        lo = self._bounds[bucket - 1] + 1 if bucket else 1
        hi = self._bounds[bucket]
        return str(hi) if lo == hi else f"{lo}-{hi}"

    kind = "bandit"

    def choose(self, batch_size: int, live: Iterable[str] = ()) -> int:
        """The depth K for an engine step running `batch_size` sequences (``live``, their request ids, is the
        goodput model's; the bandit sees only the size)."""
        bucket = self.bucket_of(batch_size)
        windows = self._rewards[bucket]
        untried = [k for k, w in zip(self._depths, windows) if len(w) < self.settings.min_observations]
        limit = self.settings.max_speculative_batch
        if limit is not None and batch_size > limit:
            depth = 0
        elif untried:
            # Every arm gets min_observations honest measurements before the greedy rule may ignore it, taken
            # in turn (the least measured first): a rollout's batch shrinks through a bucket, so arms measured
            # one after the other would each see other batch sizes, the deep ones (tried last) the smallest.
            depth = min(untried, key=lambda k: len(windows[self._arm[k]]))
        elif self._rng.random() < self.settings.epsilon:
            depth = self._explore(bucket)
        else:
            depth = self.best_depth(bucket)
        self._pulls[bucket][self._arm[depth]] += 1
        return depth

    def _explore(self, bucket: int) -> int:
        """A depth to measure instead of the best: any arm, or (``exploration: neighbours``) one next to the best."""
        if self.settings.exploration == "uniform":
            return self._rng.choice(self._depths)
        best = self._arm[self.best_depth(bucket)]  # every arm has rewards by now
        return self._depths[min(max(best + self._rng.choice((-1, 1)), 0), len(self._depths) - 1)]

    def observe(self, bucket: int, depth: int, reward: float) -> None:
        """Record the reward (generated tokens per second) of a step run with `depth` in `bucket`."""
        self._check_bucket(bucket)
        arm = self._check_depth(depth)
        # A zero-length step time gives inf, a failed measurement NaN: either would poison the median.
        if not math.isfinite(reward):
            return
        self._rewards[bucket][arm].append(float(reward))

    def observe_step(self, batch_size: int, depth: int, tokens: int, seconds: float) -> None:
        """A clean decode step of ``batch_size`` sequences at ``depth`` made ``tokens`` in ``seconds``."""
        if not (math.isfinite(seconds) and seconds > 0):
            return
        self.observe(self.bucket_of(batch_size), depth, tokens / seconds)

    def observe_drafts(self, request_id: str, drafted: int, accepted: int) -> None:
        """Per-request acceptance: the goodput model's input; the bandit's reward already holds it."""

    def forget_requests_except(self, live: Iterable[str]) -> None:
        """The goodput model's per-request counts; the bandit keeps none."""

    def estimate(self, bucket: int, depth: int) -> float | None:
        """Median of the block means of the arm's reward window in the bucket, or None if the arm was never
        observed there."""
        self._check_bucket(bucket)
        window = list(self._rewards[bucket][self._check_depth(depth)])
        if not window:
            return None
        blocks = min(self.settings.median_blocks, len(window))
        # Block b holds values [b*n//blocks, (b+1)*n//blocks): sizes differ by at most one.
        edges = [b * len(window) // blocks for b in range(blocks + 1)]
        return statistics.median(statistics.fmean(window[lo:hi]) for lo, hi in zip(edges, edges[1:]))

    def rate(self, batch_size: int, depth: int) -> float | None:
        """Tokens per second measured at ``depth`` in the bucket of ``batch_size`` (None: never tried there)."""
        return self.estimate(self.bucket_of(batch_size), depth)

    def best_depth(self, bucket: int) -> int | None:
        """The tried arm of the bucket with the highest estimate (ties go to the smaller K), or None if none was
        tried there."""
        best: tuple[float, int] | None = None
        for k in self._depths:
            value = self.estimate(bucket, k)
            if value is not None and (best is None or (value, -k) > (best[0], -best[1])):
                best = (value, k)
        return None if best is None else best[1]

    def summary(self) -> dict[str, dict]:
        """Per bucket label: best K, pulls and estimates per K (keys are str(K)), ready for JSON logs."""
        return {
            self.bucket_label(b): {
                "best": self.best_depth(b),
                "pulls": {str(k): self._pulls[b][i] for i, k in enumerate(self._depths)},
                "estimates": {str(k): self.estimate(b, k) for k in self._depths},
            }
            for b in range(self.num_buckets)
        }

    def state_dict(self) -> dict[str, Any]:
        """Full state as plain JSON types: settings, reward windows and pull counts (indexed [bucket][arm]),
        RNG state."""
        version, internal, gauss_next = self._rng.getstate()
        settings = dataclasses.asdict(self.settings)
        settings["bucket_bounds"] = list(self._bounds)
        settings["depths"] = list(self._depths)  # the arms, resolved
        settings["seed"] = self.seed
        return {
            "version": _STATE_VERSION,
            "policy": self.kind,
            "settings": settings,
            "rewards": [[list(w) for w in arms] for arms in self._rewards],
            "pulls": [list(p) for p in self._pulls],
            "rng": [version, list(internal), gauss_next],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output, of this version or an older one; buckets and depths must match this
        instance's settings.

        A version 3 state holds each batch bucket's arms per context bucket: saved without context buckets it
        held one, which loads as the bucket's arms; saved with ``context_bucket_bounds`` (removed since) it is
        refused, since each cell's rewards hold only some context lengths. The windows of credit "shallower"
        (versions 2 and 3, removed since) are not read: each estimate is its rewards'. epsilon and window are
        this instance's (so a resumed run may change them); if the window is smaller than the saved one, each arm
        keeps its newest rewards.
        """
        if state.get("policy", self.kind) != self.kind:  # states from before the key was written are a bandit's
            raise BanditConfigError(f"saved depth-policy state is '{state['policy']}', this engine's "
                                    f"speculation.policy is '{self.kind}'")
        saved = state["settings"]
        if tuple(saved["bucket_bounds"]) != self._bounds:
            raise BanditConfigError(
                f"saved bucket_bounds {tuple(saved['bucket_bounds'])} differ from this bandit's {self._bounds}."
            )
        if tuple(saved["depths"]) != self._depths:
            raise BanditConfigError(f"saved depths {tuple(saved['depths'])} differ from this bandit's {self._depths}.")
        per_context = state.get("version", 1) == 3
        if per_context and saved.get("context_bucket_bounds"):
            raise BanditConfigError(
                f"saved context_bucket_bounds {tuple(saved['context_bucket_bounds'])}: the state was saved with "
                "context buckets, an option since removed; drop the bandit's state to learn afresh.")

        def per_bucket(table: list) -> list:
            return [contexts[0] for contexts in table] if per_context else table

        version, internal, gauss_next = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss_next))
        self._rewards = [[self._new_window(w) for w in arms] for arms in per_bucket(state["rewards"])]
        self._pulls = [list(p) for p in per_bucket(state["pulls"])]

    def _check_bucket(self, bucket: int) -> None:
        if not 0 <= bucket < self.num_buckets:
            raise ValueError(f"bucket must be in [0, {self.num_buckets}), got {bucket}.")

    def _check_depth(self, depth: int) -> int:
        try:
            return self._arm[depth]
        except KeyError:
            raise ValueError(f"depth {depth} is not one of the arms {self._depths}.") from None
