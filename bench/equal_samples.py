"""One arm's step time against another's at equal samples: what TLT's online drafter costs or saves a step with
the draws held fixed.

Two speculating arms of ``bench/tlt_end_to_end.py`` sample the same distribution (speculation is lossless) but
not the same responses: the engine's RNG goes another way once their drafters differ. A step's time moves with
what it drew (how many tokens, how long the longest response, how many groups the update keeps), and on a 2-core
machine that spread is larger than the 1% a drafter comparison asks for, so a plain ratio of summed times cannot
rank the arms. Here every step of every run is one row of a least-squares fit:

    seconds = arm effect + step effect + repeat effect + b . (the step's draws) + noise

with a fixed effect per step (every run of a bench draws the same prompts at the same step: ``trainer.seed``), one
per repeat (the machine between repeats) and the draws as covariates (a phase's own: generated tokens and the
longest response for the rollout, the tokens trained for the update). The draws are the arm's in law only (the
distribution is the same in every arm), so they are fair covariates; the arm effect is then the seconds the arm
adds to a step at equal draws, with its standard error. What the drafter changes about the rollout's speed (its
acceptance) stays in the arm effect, as it should: it is what the arms differ by.

The machine moves too: on a shared 2-core host the same work ran up to 1.38x slower in one 5-minute run than in
another (2026-12-01: the update's seconds per token over a run, 0.93-1.28 ms across eight runs of one bench), so a
run's speed is a noise of its own that no step-level covariate removes, and steps of one run are not independent
draws. Two remedies, both optional:
  * ``at_machine_speed``: each run's seconds are divided by its own speed index, the update's seconds per token
    trained over the run (the same code in every arm, the policy's forward and backward: it moves with the machine,
    not with the drafter; the online arm's update also keeps its drafter features, a copy of [tokens, hidden] that
    is a sliver of it), over the mean index of the runs fitted. The update phase itself then reads ~1.0 by
    construction;
  * ``repeat_effects``: one fit per repeat (its two runs), so that the spread over repeats, which holds the runs'
    own noise, gives the standard error, not the steps' residuals.

Pure: records in, numbers out (numpy only).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

import numpy as np

# Each phase's seconds, and the draws they move with (summary.json keys; "generated_tokens" is made here).
PHASE_COVARIATES = {
    "step_seconds": ("generated_tokens", "response_length_max", "update/num_tokens"),
    "rollout_seconds": ("generated_tokens", "response_length_max"),
    "update_seconds": ("update/num_tokens",),
    "sync_seconds": (),
}


@dataclasses.dataclass(frozen=True)
class ArmEffect:
    """Seconds an arm adds to a step over the base arm at equal draws."""

    phase: str
    seconds: float
    """The arm's coefficient: its seconds a step over the base's (negative: faster)."""
    standard_error: float
    base_mean_seconds: float
    """The base arm's mean of the phase over the rows fitted: what the effect is a share of."""
    rows: int

    @property
    def ratio(self) -> float:
        """The base's time over the arm's at equal draws (frozen / on: >= 1 where the arm is faster)."""
        return self.base_mean_seconds / (self.base_mean_seconds + self.seconds)

    @property
    def ratio_standard_error(self) -> float:
        """The ratio's standard error, to first order in the effect's."""
        return self.base_mean_seconds * self.standard_error / (self.base_mean_seconds + self.seconds) ** 2


def speed_index(records: Sequence[dict], first_step: int = 2) -> float:
    """A run's machine speed: its update's seconds per token trained, over steps ``first_step``.. (module docstring)."""
    fitted = [r for r in records if r["step"] >= first_step]
    tokens = sum(r["update/num_tokens"] for r in fitted)
    if not fitted or tokens <= 0:
        raise ValueError("no update tokens to take the machine's speed from")
    return sum(r["update_seconds"] for r in fitted) / tokens


def _value(record: dict, key: str) -> float:
    if key == "generated_tokens":
        return record["response_length_mean"] * record["num_samples"]
    return float(record[key])


def arm_effect(base: Sequence[Sequence[dict]], arm: Sequence[Sequence[dict]], phase: str = "step_seconds",
               first_step: int = 2, at_machine_speed: bool = False) -> ArmEffect:
    """``arm``'s seconds a step of ``phase`` over ``base``'s at equal draws (module docstring).

    Args:
        base, arm: per repeat, each run's summary records (``summary.json``), the repeats in the same order
            (repeat i of both drew with the same sampling seed).
        phase: a key of ``PHASE_COVARIATES``.
        first_step: the first step fitted (step 1 holds the engines' first-call costs in every run).
        at_machine_speed: each run's seconds over its speed index relative to the runs' mean (``speed_index``).
    """
    if phase not in PHASE_COVARIATES:
        raise ValueError(f"phase must be one of {sorted(PHASE_COVARIATES)}, got {phase!r}")
    if len(base) != len(arm) or not base:
        raise ValueError(f"need the same number of repeats (>= 1) in both arms, got {len(base)} and {len(arm)}")
    covariates = PHASE_COVARIATES[phase]
    speeds = {(which, repeat): speed_index(records, first_step) if at_machine_speed else 1.0
              for which, runs in ((0.0, base), (1.0, arm)) for repeat, records in enumerate(runs)}
    mean_speed = sum(speeds.values()) / len(speeds)
    rows, y = [], []
    for which, runs in ((0.0, base), (1.0, arm)):
        for repeat, records in enumerate(runs):
            scale = mean_speed / speeds[which, repeat]
            for record in records:
                if record["step"] < first_step:
                    continue
                rows.append((which, repeat, record["step"], [_value(record, k) for k in covariates]))
                y.append(float(record[phase]) * scale)
    steps = sorted({r[2] for r in rows})
    repeats = len(base)
    # Columns: intercept, arm, one per step but the first, one per repeat but the first, the covariates.
    x = np.zeros((len(rows), 2 + (len(steps) - 1) + (repeats - 1) + len(covariates)))
    for i, (which, repeat, step, values) in enumerate(rows):
        x[i, 0], x[i, 1] = 1.0, which
        if (s := steps.index(step)) > 0:
            x[i, 1 + s] = 1.0
        if repeat > 0:
            x[i, len(steps) + repeat] = 1.0
        x[i, len(steps) + repeats:] = values
    y_arr = np.asarray(y)
    coef, _, rank, _ = np.linalg.lstsq(x, y_arr, rcond=None)
    freedom = len(y_arr) - rank
    if freedom <= 0:
        raise ValueError(f"{len(y_arr)} rows cannot fit {rank} effects: run more steps or repeats")
    residual = y_arr - x @ coef
    sigma2 = float(residual @ residual) / freedom
    covariance = sigma2 * np.linalg.pinv(x.T @ x)
    base_mean = float(np.mean([v for (which, *_), v in zip(rows, y) if which == 0.0]))
    return ArmEffect(phase=phase, seconds=float(coef[1]), standard_error=float(np.sqrt(covariance[1, 1])),
                     base_mean_seconds=base_mean, rows=len(y_arr))


def repeat_effects(base: Sequence[Sequence[dict]], arm: Sequence[Sequence[dict]], phase: str = "step_seconds",
                   first_step: int = 2, at_machine_speed: bool = False) -> list[ArmEffect]:
    """``arm_effect`` fitted on each repeat's two runs alone, repeat by repeat (their spread is the honest error)."""
    if len(base) != len(arm):
        raise ValueError(f"need the same number of repeats in both arms, got {len(base)} and {len(arm)}")
    return [arm_effect([b], [a], phase, first_step, at_machine_speed) for b, a in zip(base, arm)]


def mean_ratio(effects: Sequence[ArmEffect]) -> tuple[float, float | None]:
    """The mean of the repeats' ratios (base / arm) and its standard error over repeats (None from one repeat)."""
    ratios = [e.ratio for e in effects]
    se = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else None
    return statistics.fmean(ratios), se
