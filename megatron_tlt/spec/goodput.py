"""Goodput depth model: the speculation depth of each engine step from the live requests' own acceptance
and a fitted step cost, where BEG-MAB (``spec/bandit.py``) samples a reward per bucket and depth.

A step at depth K advances request i by E_i(K) tokens in expectation and takes t(B, K) seconds for a batch of
B, so the step's goodput is sum_i E_i(K) / t(B, K). Both parts are estimated apart, each from what informs it:
  * acceptance, per request and draft position: the engine-wide rate at each position k (a_k: accepted of the
    drafts that reached k; deep positions are harder, so one rate for all would overrate deep drafts), scaled
    by how request i's own drafts so far compare with the engine's (r_i, shrunk toward 1):
    E_i(K) = 1 + sum_{k<=K} prod_{j<=k} min(1, r_i a_j).
    Requests differ a lot (a copied line is easy to draft, a fresh number is not), and in the long tail the
    few requests still live are the ones that set the rollout's makespan: the depth is chosen for them, not
    for the average request of the whole rollout, which a reward window per bucket remembers;
  * cost, t(B, K) = c0 + c1 B + c2 K + c3 B K, fitted by least squares on the clean decode steps of every
    depth and batch size (one outlier pass: a GC pause or a weight sync must not bend the line). One fit shares
    what each depth's steps say about the others, where the bandit learns each (bucket, depth) cell alone.

Every depth gets ``min_observations`` clean steps before the fit is trusted, and a share ``epsilon`` of steps
explores a depth next to the chosen one, so the fit keeps seeing the depths that compete as the batch shrinks
(a random depth, as BEG-MAB explores, often costs a step at K=0); a depth whose steps have all left the window
is measured again. Ties go to the smaller K. The fit is redone
every ``_REFIT_EVERY`` new steps: a step takes milliseconds here, and the choice must cost far less.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import random
from collections.abc import Iterable
from typing import Any

import numpy as np

from megatron_tlt.config import SpeculationConfig
from megatron_tlt.spec.bandit import BanditConfigError, BucketedEpsilonGreedy

_STATE_VERSION = 1
KIND = "goodput"
_PRIOR_POSITIONS = 8.0
"""Draft positions of prior, at the engine-wide rate, that a request's own counts are shrunk toward."""
_GLOBAL_DECAY = 0.995
"""Per observed step: how much of the engine-wide acceptance counts is kept (it follows the drafter)."""
_OUTLIER_MADS = 4.0
_REFIT_EVERY = 16


@dataclasses.dataclass
class _Drafts:
    reached: float = 0.0
    accepted: float = 0.0

    def rate(self) -> float:
        return (self.accepted + 0.5) / (self.reached + 1.0)


class GoodputDepthModel:
    """Chooses depths among ``settings.arms(max_depth)``; the same surface as ``BucketedEpsilonGreedy`` where the
    scheduler and the engine use it (``choose``, ``observe_step``, ``observe_drafts``, ``summary``, state)."""

    kind = KIND

    def __init__(self, settings: SpeculationConfig, *, max_depth: int, seed: int = 0) -> None:
        self.settings = settings
        self.max_depth = max_depth
        self.seed = seed
        self._depths = settings.arms(max_depth)
        if settings.window < settings.min_observations * len(self._depths):
            raise BanditConfigError(
                f"speculation.window={settings.window} cannot hold min_observations={settings.min_observations} steps "
                f"of each of the {len(self._depths)} depths {self._depths}: the goodput model would never stop trying "
                "them; raise the window or lower min_observations")
        self._buckets = BucketedEpsilonGreedy(settings, max_depth=max_depth)  # bucket labels for the summary
        self._rng = random.Random(seed)
        self._steps: collections.deque[tuple[int, int, float]] = collections.deque(maxlen=settings.window)
        self._engine = _Drafts()
        self._positions = [_Drafts() for _ in range(max(self._depths))]  # engine-wide, per draft position
        self._requests: dict[str, _Drafts] = {}
        self._pulls = {k: 0 for k in self._depths}
        self._in_window = collections.Counter()  # steps per depth in the window, kept as it slides
        self._cost: np.ndarray | None = None  # c0, c1, c2, c3
        self._floor = 1e-6  # the fastest step in the window at the last fit: no prediction goes below it
        self._unfitted_steps = 0  # observed since the last fit

    # ------------------------------------------------------------------ what the engine reports

    def observe_drafts(self, request_id: str, drafted: int, accepted: int) -> None:
        """A request's drafts in one step: ``drafted`` proposed, the first ``accepted`` of them taken."""
        if drafted <= 0:
            return
        reached = min(accepted + 1, drafted)  # positions past the first rejection were never judged
        mine = self._requests.setdefault(request_id, _Drafts())
        mine.reached += reached
        mine.accepted += accepted
        self._engine.reached += reached
        self._engine.accepted += accepted
        for k in range(min(reached, len(self._positions))):
            self._positions[k].reached += 1
            self._positions[k].accepted += k < accepted

    def observe_step(self, batch_size: int, depth: int, tokens: int, seconds: float) -> None:
        """A clean decode step: ``batch_size`` requests at ``depth`` took ``seconds`` (``tokens`` is BEG-MAB's; this
        model counts acceptance per request, in ``observe_drafts``)."""
        if depth not in self._pulls:
            raise ValueError(f"depth {depth} is not one of the arms {self._depths}.")
        if not (math.isfinite(seconds) and seconds > 0):
            return
        if len(self._steps) == self._steps.maxlen:
            self._in_window[self._steps[0][1]] -= 1
        self._steps.append((batch_size, depth, seconds))
        self._in_window[depth] += 1
        for counts in (self._engine, *self._positions):
            counts.reached *= _GLOBAL_DECAY
            counts.accepted *= _GLOBAL_DECAY
        self._unfitted_steps += 1

    def forget_requests_except(self, live: Iterable[str]) -> None:
        """Drop the counts of requests that are no longer live."""
        keep = set(live)
        for request_id in [r for r in self._requests if r not in keep]:
            del self._requests[request_id]

    # ------------------------------------------------------------------ the choice

    def engine_acceptance(self) -> float:
        """Engine-wide acceptance over all draft positions (0.5 before any draft was judged)."""
        return self._engine.rate()

    def position_acceptance(self) -> np.ndarray:
        """Engine-wide acceptance of draft position 1, 2, ... (of the drafts that reached it)."""
        return np.array([p.rate() for p in self._positions])

    def request_acceptance(self, request_id: str) -> float:
        """How a request's drafts compare with the engine's: its acceptance / the engine's (1: as the engine)."""
        return self._relative(request_id, self.engine_acceptance())

    def _relative(self, request_id: str, prior: float) -> float:
        mine = self._requests.get(request_id)
        if mine is None:
            return 1.0
        return (mine.accepted + _PRIOR_POSITIONS * prior) / (mine.reached + _PRIOR_POSITIONS) / prior

    def choose(self, batch_size: int, live: Iterable[str] = ()) -> int:
        """The depth for a step of ``batch_size`` requests, ``live`` naming them (unknown ones get the engine's
        rate, as do the missing ones when fewer than ``batch_size`` are named)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        limit = self.settings.max_speculative_batch
        # Counted in the window: a depth whose steps have all left it is measured again (its line was extrapolated).
        untried = [k for k in self._depths if self._in_window[k] < self.settings.min_observations]
        if limit is not None and batch_size > limit:
            depth = 0
        elif untried:
            depth = untried[0]
        else:
            prior = self.engine_acceptance()
            depth = self.best_depth_for(batch_size, [self._relative(r, prior) for r in live])
            if self._rng.random() < self.settings.epsilon:
                i = self._depths.index(depth) + self._rng.choice((-1, 1))
                depth = self._depths[min(max(i, 0), len(self._depths) - 1)]
        self._pulls[depth] += 1
        return depth

    def best_depth_for(self, batch_size: int, relative: list[float]) -> int:
        """The depth of the highest predicted goodput for ``batch_size`` requests whose acceptances relative to the
        engine's are ``relative`` (1 for requests not given)."""
        ratios = np.ones(batch_size)
        given = np.asarray(relative[:batch_size], dtype=np.float64)
        ratios[:len(given)] = given
        tokens = self._expected_tokens(ratios)
        return max(self._depths, key=lambda k: (tokens[k] / self.step_seconds(batch_size, k), -k))

    @property
    def _ready(self) -> bool:
        """Whether the cost fit has steps enough to predict from."""
        return self._cost is not None or len(self._steps) >= 4

    def rate(self, batch_size: int, depth: int) -> float | None:
        """Predicted tokens per second at ``depth`` for ``batch_size`` average requests (None: not fitted yet)."""
        return self.goodput(batch_size, depth) if self._ready else None

    def goodput(self, batch_size: int, depth: int, relative=None) -> float:
        """Predicted tokens per second of a step at ``depth`` for ``batch_size`` requests (``relative`` as above)."""
        ratios = np.ones(batch_size) if relative is None else np.asarray(relative, dtype=np.float64)
        return float(self._expected_tokens(ratios)[depth]) / self.step_seconds(batch_size, depth)

    def _expected_tokens(self, ratios: np.ndarray) -> np.ndarray:
        """Tokens the requests gain together in a step at each depth 0..max: 1 each, plus each draft position
        reached and accepted."""
        per_position = np.minimum(1.0, ratios[:, None] * self.position_acceptance()[None, :])  # [requests, K]
        reached_and_accepted = np.cumprod(per_position, axis=1).sum(axis=0)
        return len(ratios) + np.concatenate([[0.0], np.cumsum(reached_and_accepted)])

    def step_seconds(self, batch_size: int, depth: int) -> float:
        """The fitted time of a step (never below the fastest step observed, nor 0 before any)."""
        if self._cost is None or self._unfitted_steps >= _REFIT_EVERY:
            self._cost, self._unfitted_steps = self._fit(), 0
            self._floor = min((s for _, _, s in self._steps), default=1e-6)
        if self._cost is None:
            return self._floor
        c0, c1, c2, c3 = self._cost
        return max(self._floor, float(c0 + c1 * batch_size + c2 * depth + c3 * batch_size * depth))

    def _fit(self) -> np.ndarray | None:
        if len(self._steps) < 4:
            return None
        rows = np.array(self._steps, dtype=np.float64)
        b, k, t = rows[:, 0], rows[:, 1], rows[:, 2]
        design = np.stack([np.ones_like(b), b, k, b * k], axis=1)
        coef = np.linalg.lstsq(design, t, rcond=None)[0]
        residual = np.abs(t - design @ coef)
        keep = residual <= _OUTLIER_MADS * (np.median(residual) * 1.4826 + 1e-9)  # drop the outliers, fit again
        return np.linalg.lstsq(design[keep], t[keep], rcond=None)[0] if keep.sum() >= 4 else coef

    # ------------------------------------------------------------------ reports and state

    def summary(self) -> dict[str, dict]:
        """Per batch-size bucket label (as BEG-MAB's): the depth chosen at the bucket's largest batch with the
        engine's rate, pulls per depth (over all buckets) and the predicted tokens/s per depth."""
        out = {}
        bounds = self.settings.bucket_bounds
        ready = self._ready
        for bucket in range(len(bounds) + 1):
            batch = bounds[bucket] if bucket < len(bounds) else bounds[-1] + 1
            out[self._buckets.bucket_label(bucket)] = {
                "best": self.best_depth_for(batch, []) if ready else None,
                "pulls": {str(k): v for k, v in self._pulls.items()},
                "estimates": {str(k): self.goodput(batch, k) if ready else None for k in self._depths},
            }
        return out

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss_next = self._rng.getstate()
        return {"version": _STATE_VERSION, "policy": KIND, "depths": list(self._depths),
                "steps": [list(s) for s in self._steps],
                "engine": [self._engine.reached, self._engine.accepted],
                "positions": [[p.reached, p.accepted] for p in self._positions],
                "pulls": {str(k): v for k, v in self._pulls.items()},
                "rng": [version, list(internal), gauss_next]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output (requests live in one rollout only: none are kept)."""
        if state.get("policy") != KIND:
            raise BanditConfigError(f"saved depth-policy state is '{state.get('policy', 'bandit')}', this engine's "
                                    f"speculation.policy is '{KIND}'")
        if tuple(state["depths"]) != self._depths:
            raise BanditConfigError(f"saved depths {tuple(state['depths'])} differ from this model's {self._depths}.")
        version, internal, gauss_next = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss_next))
        self._steps = collections.deque((tuple(s) for s in state["steps"]), maxlen=self.settings.window)
        self._in_window = collections.Counter(k for _, k, _ in self._steps)
        self._engine = _Drafts(*state["engine"])
        self._positions = [_Drafts(*p) for p in state["positions"]]
        self._pulls = {int(k): v for k, v in state["pulls"].items()}
        self._requests = {}
        self._cost, self._unfitted_steps = None, 0
