"""BEG-MAB: the bucketed epsilon-greedy multi-armed bandit that picks the speculation depth K.

Each engine step the rollout engine asks for a depth K (0 = speculation off) and later reports a
reward: generated tokens per second of that step. Arms are the depths; the best one depends on the
batch size (speculation pays at small batches, where decoding is memory-bound and spare compute
verifies drafts for free, but not at large ones), so every batch-size bucket runs its own bandit. With
``context_bucket_bounds`` every (batch-size bucket, context-length bucket) cell runs its own: acceptance falls as
contexts grow, and the rollout's long tail is a few long requests, so two short requests and two long ones may
want different depths. A step's context length is the scheduler's (the mean over the live requests of their tokens
so far); without context bounds there is one context bucket, the bandit as before.

An arm's estimate comes from its last `window` rewards; the sliding window forgets old rewards so the
choice follows a drafter that improves, or degrades, with every RL step. The estimate is TLT's
median, taken over the means of `median_blocks` consecutive blocks of the window rather than over
single rewards. Either median shrugs off a noisy step time (a GC pause, a weight sync). But at small
batches a step's reward takes only a few values (batch 1, depth K: 1..K+1 tokens), and the median of
so few values is not the throughput. At batch 1 on the tiny default the plain median said 353
tokens/s for K=2 and 277 for K=1, where their steps made 274 and 221.

With ``credit: shallower`` a step at depth K also measures every shallower depth: the tokens each request
would have made (``observe_step``'s ``accepted``), and a depth's estimate is its tokens per request times
its requests per second (``SpeculationConfig.credit``).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
import random
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from megatron_tlt.config import ConfigError, SpeculationConfig

_STATE_VERSION = 3  # 2: the windows of credit "shallower" (yields, paces); 3: per context bucket too


def _range_label(bounds: tuple[int, ...], index: int) -> str:
    """The range of bucket ``index`` of inclusive upper ``bounds`` starting at 1: "1", "3-5", "33+"."""
    if index == len(bounds):
        return f"{bounds[-1] + 1}+"
    lo = bounds[index - 1] + 1 if index else 1
    hi = bounds[index]
    return str(hi) if lo == hi else f"{lo}-{hi}"


class BanditConfigError(ConfigError):
    """A bandit that cannot run with these arms or this saved state; the message names the values."""


class BucketedEpsilonGreedy:
    """One epsilon-greedy bandit over the arms of ``settings`` (``speculation.*``) per batch-size bucket and
    context-length bucket (a cell). Methods that take a ``bucket`` (batch-size bucket) take its ``context_bucket``
    too, 0 by default: the only one without ``context_bucket_bounds``.

    ``settings.depths`` None gives the arms 0..``max_depth``, the deepest speculation the engine is built
    for; ``SpeculationConfig`` has checked its own values when it was built, the arms against
    ``max_depth`` are checked here. ``seed`` seeds the bandit's own exploration.
    """

    def __init__(self, settings: SpeculationConfig, *, max_depth: int, seed: int = 0) -> None:
        self.settings = settings
        self.max_depth = max_depth
        self.seed = seed
        self._bounds = tuple(settings.bucket_bounds)
        self._context_bounds = tuple(settings.context_bucket_bounds)
        self._depths = settings.arms(max_depth)
        self._arm = {k: i for i, k in enumerate(self._depths)}
        # Own generator, so the engine's other randomness neither disturbs nor is disturbed by ours.
        self._rng = random.Random(seed)
        # Per cell (batch bucket, context bucket), per arm:
        self._rewards = self._new_cells(lambda: [self._new_window() for _ in self._depths])
        # credit "shallower": tokens per request (own and deeper steps) and requests per second (own steps)
        self._yields = self._new_cells(lambda: [self._new_window() for _ in self._depths])
        self._paces = self._new_cells(lambda: [self._new_window() for _ in self._depths])
        self._pulls = self._new_cells(lambda: [0] * len(self._depths))

    def _new_window(self, values: Iterable[float] = ()) -> collections.deque[float]:
        return collections.deque(values, maxlen=self.settings.window)

    def _new_cells(self, make) -> dict[tuple[int, int], Any]:
        return {cell: make() for cell in self.cells()}

    def cells(self) -> list[tuple[int, int]]:
        """Every (batch bucket, context bucket), the smallest batches first, then the shortest contexts."""
        return [(b, c) for b in range(self.num_buckets) for c in range(self.num_context_buckets)]

    @property
    def num_buckets(self) -> int:
        """Batch-size buckets."""
        return len(self._bounds) + 1

    @property
    def num_context_buckets(self) -> int:
        return len(self._context_bounds) + 1

    def context_bucket_of(self, context_tokens: float) -> int:
        """Index of the context bucket holding a step of mean context length ``context_tokens`` (>= 0)."""
        if not context_tokens >= 0:  # NaN too
            raise ValueError(f"context_tokens must be >= 0, got {context_tokens}.")
        # inclusive upper ends, as the batch-size bounds; a mean between two bounds (256.5) goes up
        return bisect.bisect_left(self._context_bounds, context_tokens)

    def context_bucket_label(self, context_bucket: int) -> str:
        """Token range of a context bucket: "1-256", "257-512", "513+" ("any" without context bounds)."""
        self._check_context_bucket(context_bucket)
        return _range_label(self._context_bounds, context_bucket) if self._context_bounds else "any"

    def cell_label(self, bucket: int, context_bucket: int = 0) -> str:
        """A cell's label in ``summary``: the batch-size range alone without context bounds ("3-5", as before),
        else with the context range ("3-5, ctx 257-512")."""
        batch = self.bucket_label(bucket)
        if not self._context_bounds:
            return batch
        return f"{batch}, ctx {self.context_bucket_label(context_bucket)}"

    def bucket_of(self, batch_size: int) -> int:
        """Index of the bucket holding `batch_size` (>= 1)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        # Bounds are inclusive upper ends, so the first bound >= batch_size names the bucket.
        return bisect.bisect_left(self._bounds, batch_size)

    def bucket_label(self, bucket: int) -> str:
        """Human-readable batch-size range of a bucket: "1", "3-5", "33+"."""
        self._check_bucket(bucket)
        return _range_label(self._bounds, bucket)

    kind = "bandit"

    def choose(self, batch_size: int, live: Iterable[str] = (), context_tokens: float = 0) -> int:
        """The depth K for an engine step running `batch_size` sequences of mean context length
        ``context_tokens`` (``live``, their request ids, is the goodput model's; the bandit sees only the sizes)."""
        cell = (self.bucket_of(batch_size), self.context_bucket_of(context_tokens))
        windows = self._rewards[cell]
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
            depth = self._explore(*cell)
        else:
            depth = self.best_depth(*cell)
        self._pulls[cell][self._arm[depth]] += 1
        return depth

    def _explore(self, bucket: int, context_bucket: int) -> int:
        """A depth to measure instead of the best: any arm, or (``exploration: neighbours``) one next to the best."""
        if self.settings.exploration == "uniform":
            return self._rng.choice(self._depths)
        best = self._arm[self.best_depth(bucket, context_bucket)]  # every arm has rewards by now
        return self._depths[min(max(best + self._rng.choice((-1, 1)), 0), len(self._depths) - 1)]

    def observe(self, bucket: int, depth: int, reward: float, context_bucket: int = 0) -> None:
        """Record the reward (generated tokens per second) of a step run with `depth` in the cell
        (`bucket`, `context_bucket`)."""
        cell = self._check_cell(bucket, context_bucket)
        arm = self._check_depth(depth)
        # A zero-length step time gives inf, a failed measurement NaN: either would poison the median.
        if not math.isfinite(reward):
            return
        self._rewards[cell][arm].append(float(reward))

    def observe_step(self, batch_size: int, depth: int, tokens: int, seconds: float,
                     accepted: Sequence[int] = (), context_tokens: float = 0) -> None:
        """A clean decode step of ``batch_size`` sequences of mean context length ``context_tokens`` at ``depth``
        made ``tokens`` in ``seconds``; ``accepted``: how many drafts each request that drafted had accepted
        (credit "shallower" reads it)."""
        if not (math.isfinite(seconds) and seconds > 0):
            return
        cell = (self.bucket_of(batch_size), self.context_bucket_of(context_tokens))
        self.observe(cell[0], depth, tokens / seconds, context_bucket=cell[1])
        if self.settings.credit == "own":
            return
        arm = self._check_depth(depth)
        self._paces[cell][arm].append(batch_size / seconds)
        self._yields[cell][arm].append(tokens / batch_size)
        for shallower in self._depths:
            if shallower < depth:
                # its drafts would be the first `shallower` of these; every request makes one token more
                made = batch_size + sum(min(count, shallower) for count in accepted)
                self._yields[cell][self._arm[shallower]].append(made / batch_size)

    def observe_drafts(self, request_id: str, drafted: int, accepted: int) -> None:
        """Per-request acceptance: the goodput model's input; the bandit's reward already holds it."""

    def forget_requests_except(self, live: Iterable[str]) -> None:
        """The goodput model's per-request counts; the bandit keeps none."""

    def estimate(self, bucket: int, depth: int, context_bucket: int = 0) -> float | None:
        """Median of the block means of the arm's reward window in the cell (credit "shallower": of its tokens per
        request times that of its requests per second), or None if the arm was never observed there."""
        cell = self._check_cell(bucket, context_bucket)
        arm = self._check_depth(depth)
        if not self._rewards[cell][arm]:
            return None
        if self.settings.credit == "own" or not self._paces[cell][arm]:  # a state saved under credit "own"
            return self._block_median(self._rewards[cell][arm])
        return self._block_median(self._yields[cell][arm]) * self._block_median(self._paces[cell][arm])

    def _block_median(self, values: Iterable[float]) -> float:
        window = list(values)
        blocks = min(self.settings.median_blocks, len(window))
        # Block b holds values [b*n//blocks, (b+1)*n//blocks): sizes differ by at most one.
        edges = [b * len(window) // blocks for b in range(blocks + 1)]
        return statistics.median(statistics.fmean(window[lo:hi]) for lo, hi in zip(edges, edges[1:]))

    def rate(self, batch_size: int, depth: int, context_tokens: float = 0) -> float | None:
        """Tokens per second measured at ``depth`` in the cell of ``batch_size`` and ``context_tokens`` (None: never
        tried there)."""
        return self.estimate(self.bucket_of(batch_size), depth, self.context_bucket_of(context_tokens))

    def best_depth(self, bucket: int, context_bucket: int = 0) -> int | None:
        """The tried arm of the cell with the highest estimate (ties go to the smaller K), or None if none was
        tried there."""
        best: tuple[float, int] | None = None
        for k in self._depths:
            value = self.estimate(bucket, k, context_bucket)
            if value is not None and (best is None or (value, -k) > (best[0], -best[1])):
                best = (value, k)
        return None if best is None else best[1]

    def summary(self) -> dict[str, dict]:
        """Per cell label (``cell_label``): best K, pulls and estimates per K (keys are str(K)), ready for JSON
        logs."""
        return {
            self.cell_label(*cell): {
                "best": self.best_depth(*cell),
                "pulls": {str(k): self._pulls[cell][i] for i, k in enumerate(self._depths)},
                "estimates": {str(k): self.estimate(cell[0], k, cell[1]) for k in self._depths},
            }
            for cell in self.cells()
        }

    def _nested(self, per_cell: dict[tuple[int, int], list], convert) -> list:
        """[batch bucket][context bucket][arm] lists of a per-cell table, for JSON."""
        return [[[convert(v) for v in per_cell[(b, c)]] for c in range(self.num_context_buckets)]
                for b in range(self.num_buckets)]

    def state_dict(self) -> dict[str, Any]:
        """Full state as plain JSON types: settings, reward windows and pull counts (indexed [batch bucket]
        [context bucket][arm]), RNG state."""
        version, internal, gauss_next = self._rng.getstate()
        settings = dataclasses.asdict(self.settings)
        settings["bucket_bounds"] = list(self._bounds)
        settings["context_bucket_bounds"] = list(self._context_bounds)
        settings["depths"] = list(self._depths)  # the arms, resolved
        settings["seed"] = self.seed
        return {
            "version": _STATE_VERSION,
            "policy": self.kind,
            "settings": settings,
            "rewards": self._nested(self._rewards, list),
            "yields": self._nested(self._yields, list),
            "paces": self._nested(self._paces, list),
            "pulls": self._nested(self._pulls, int),
            "rng": [version, list(internal), gauss_next],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output; buckets (batch and context) and depths must match this instance's settings.

        A state saved before context buckets existed (version < 3) is a bandit with one context bucket: it loads
        into a bandit without ``context_bucket_bounds`` as it always did, and is refused by one with them, as any
        other change of buckets is (its rewards mix all context lengths: they would mislead every context cell).
        epsilon and window are this instance's (so a resumed run may change them); if the window is
        smaller than the saved one, each arm keeps its newest rewards.
        """
        if state.get("policy", self.kind) != self.kind:  # states from before the key was written are a bandit's
            raise BanditConfigError(f"saved depth-policy state is '{state['policy']}', this engine's "
                                    f"speculation.policy is '{self.kind}'")
        saved = state["settings"]
        if tuple(saved["bucket_bounds"]) != self._bounds:
            raise BanditConfigError(
                f"saved bucket_bounds {tuple(saved['bucket_bounds'])} differ from this bandit's {self._bounds}."
            )
        per_context = state.get("version", 1) >= 3
        saved_context = tuple(saved.get("context_bucket_bounds", ())) if per_context else ()
        if saved_context != self._context_bounds:
            raise BanditConfigError(
                f"saved context_bucket_bounds {saved_context} differ from this bandit's {self._context_bounds}"
                + ("" if per_context else " (the state was saved before context buckets existed: one bucket)")
                + "; resume with the saved bounds, or drop the bandit's state to learn the new cells afresh.")
        if tuple(saved["depths"]) != self._depths:
            raise BanditConfigError(f"saved depths {tuple(saved['depths'])} differ from this bandit's {self._depths}.")

        def cells_of(table: list) -> dict[tuple[int, int], list]:
            # before version 3 a batch bucket held its arms directly: they are its one context bucket's
            nested = table if per_context else [[arms] for arms in table]
            return {(b, c): arms for b, contexts in enumerate(nested) for c, arms in enumerate(contexts)}

        version, internal, gauss_next = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss_next))
        empty = {cell: [[] for _ in self._depths] for cell in self.cells()}  # a version 1 state has no yields, paces
        self._rewards = {cell: [self._new_window(w) for w in arms] for cell, arms in cells_of(state["rewards"]).items()}
        self._yields = {cell: [self._new_window(w) for w in arms]
                        for cell, arms in (cells_of(state["yields"]) if "yields" in state else empty).items()}
        self._paces = {cell: [self._new_window(w) for w in arms]
                       for cell, arms in (cells_of(state["paces"]) if "paces" in state else empty).items()}
        self._pulls = {cell: list(p) for cell, p in cells_of(state["pulls"]).items()}

    def _check_bucket(self, bucket: int) -> None:
        if not 0 <= bucket < self.num_buckets:
            raise ValueError(f"bucket must be in [0, {self.num_buckets}), got {bucket}.")

    def _check_context_bucket(self, context_bucket: int) -> None:
        if not 0 <= context_bucket < self.num_context_buckets:
            raise ValueError(f"context_bucket must be in [0, {self.num_context_buckets}), got {context_bucket}.")

    def _check_cell(self, bucket: int, context_bucket: int) -> tuple[int, int]:
        self._check_bucket(bucket)
        self._check_context_bucket(context_bucket)
        return bucket, context_bucket

    def _check_depth(self, depth: int) -> int:
        try:
            return self._arm[depth]
        except KeyError:
            raise ValueError(f"depth {depth} is not one of the arms {self._depths}.") from None
