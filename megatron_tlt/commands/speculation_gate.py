"""Whether a new run's engines speculate: a drafter that cannot repay what a speculating engine costs is not served.

A speculating vLLM engine runs its EAGLE drafter at every step, depth 0 included, so that the drafter's KV cache
stays whole for the steps that draft again (what makes switching depth safe). That cost is paid whatever depth the
bandit picks: on the CPU a speculating engine's depth-0 steps took 1.08-1.22x a plain engine's on SmolLM2-135M, and
it ran at 0.82x a plain engine's speed on the tiny default (bench/RESULTS.md). A drafter that speculation cannot make
pay (its ceiling, ``spec/ceiling.py``, below ``speculation.min_ceiling``) then only slows the rollout. Such a run
rolls out on plain engines (``drafter.depth`` 0 in its config.yaml, so a resumed run stays so) and still trains the
drafter on idle ranks where ``drafter.spot_training`` is on.

The judgement reads the held-out acceptance a cold start records with its drafter, at the depths the run may draft
(the bandit's arms, or drafter.depth alone without BEG-MAB), at the run's sampling: acceptance is a function of the
temperature and the draft sampling (``drafter/quality.py``), so a record measured at another temperature does not
judge the run. The cache key holds the temperature but not the draft sampling, so a cold start records its
acceptance with each draft sampling. ``rollout.top_p`` is not compared (a known gap; it shapes the held-out
responses too). A drafter that cannot be judged (a random start, a spot-trained checkpoint, a user's own, a record
at another sampling) is served as configured; records made before cold starts named their sampling are taken as
they are. The ceiling assumes verifying is free, so 1.1 is a bound on what can pay, not a measured break-even: a
CPU pays for verification, and a ceiling above 1.1 there can still lose.
"""
from __future__ import annotations

import dataclasses
import json

from megatron_tlt.config import TLTConfig
from megatron_tlt.drafter import store
from megatron_tlt.formats.architecture import PolicyArchitecture
from megatron_tlt.spec.ceiling import SpeculationCeiling, drafter_cost_share, speculation_ceiling

ACCEPTANCE_KEY = "held_out_acceptance_by_position_after"
"""The starting drafter's held-out acceptance per draft position, as ``tlt warmup-drafter`` records it."""
TEMPERATURE_KEY = "held_out_temperature"
DRAFT_SAMPLING_KEY = "held_out_draft_sampling"
# the sampling that acceptance was measured at, named by the config keys they record
RECORDED_AS = {TEMPERATURE_KEY: "rollout.temperature", DRAFT_SAMPLING_KEY: "speculation.draft_sampling"}
BY_DRAFT_SAMPLING_KEY = "held_out_acceptance_by_draft_sampling_after"
"""The same acceptance with each draft sampling, {"probabilistic": [...], "greedy": [...]} (sampled rollouts)."""


def measured_at(config: TLTConfig) -> dict:
    """The record's fields naming the sampling a held-out acceptance measured with ``config`` is taken at."""
    return {TEMPERATURE_KEY: config.rollout.temperature, DRAFT_SAMPLING_KEY: config.speculation.draft_sampling}


@dataclasses.dataclass(frozen=True)
class SpeculationVerdict:
    serve: bool
    """Whether the engines speculate with the drafter."""
    ceiling: SpeculationCeiling | None
    """The drafter's ceiling; None where it could not be judged (``unjudged`` says why)."""
    min_ceiling: float
    unjudged: str | None = None
    """Why the drafter could not be judged, where ``ceiling`` is None."""

    def to_json(self) -> str:
        ceiling = self.ceiling
        return json.dumps({"serve": self.serve, "ceiling": ceiling.speedup if ceiling else None,
                           "ceiling_depth": ceiling.depth if ceiling else None,
                           "cost_share": ceiling.cost_share if ceiling else None, "min_ceiling": self.min_ceiling,
                           "unjudged": self.unjudged}, indent=1)

    def describe(self) -> str:
        if self.ceiling is None:
            return f"speculation: on as configured ({self.unjudged})"
        if self.serve:
            return (f"speculation: on; the starting drafter's ceiling {self.ceiling.speedup:.2f}x reaches "
                    f"speculation.min_ceiling {self.min_ceiling:g}")
        return (f"speculation: OFF for this run: the starting drafter can make rollouts at most "
                f"{self.ceiling.speedup:.2f}x faster (its held-out acceptance, verifying free), below "
                f"speculation.min_ceiling {self.min_ceiling:g}, and a speculating engine runs its drafter at every "
                f"step; the engines roll out without drafts (drafter.depth 0 in the run's config.yaml) and the "
                f"drafter still trains on idle ranks if drafter.spot_training is on. speculation.min_ceiling=0 "
                f"speculates anyway (docs/tlt.md)")


def measured_prefix(record) -> list[float]:
    """The leading acceptances of a drafter's record that are measured: numbers in [0, 1] (NaN: no held-out chain
    reached that position; anything else is not a measurement)."""
    prefix = []
    for value in record if isinstance(record, list) else []:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            break
        prefix.append(float(value))
    return prefix


def usable_depths(config: TLTConfig) -> tuple[int, ...]:
    """The depths the run's engines may draft at: the bandit's arms, or drafter.depth alone without it."""
    d, s = config.drafter, config.speculation
    return s.arms(d.depth) if s.adaptive else (d.depth,)


def judge(config: TLTConfig, arch: PolicyArchitecture) -> SpeculationVerdict:
    """The verdict on the drafter ``drafter.init_dir`` holds for a run of ``config`` on a policy of ``arch``, at
    the depths the run may draft (its measured ones)."""
    threshold = config.speculation.min_ceiling
    acceptance, unjudged = acceptance_at_the_runs_sampling(store.read_drafter_info(config.drafter.init_dir), config)
    if unjudged is not None:
        return SpeculationVerdict(True, None, threshold, unjudged=unjudged)
    ceiling = None
    if acceptance:
        ceiling = speculation_ceiling(acceptance, drafter_cost_share(arch), depths=usable_depths(config))
    if ceiling is None:
        return SpeculationVerdict(True, None, threshold, unjudged=(
            "the starting drafter records no held-out acceptance at the depths this run drafts, to judge it by"))
    return SpeculationVerdict(ceiling.speedup >= threshold, ceiling, threshold)


def acceptance_at_the_runs_sampling(record: dict, config: TLTConfig) -> tuple[list[float], str | None]:
    """The record's measured held-out acceptance per position at the run's sampling, or why it has none there (a
    sentence). A record that names no sampling (made before the fields) is taken as it is."""
    run = measured_at(config)
    temperature = record.get(TEMPERATURE_KEY, run[TEMPERATURE_KEY])
    if temperature != run[TEMPERATURE_KEY]:
        return [], _other_sampling(TEMPERATURE_KEY, temperature, run)
    drafted = record.get(DRAFT_SAMPLING_KEY, run[DRAFT_SAMPLING_KEY])
    if temperature == 0 or drafted == run[DRAFT_SAMPLING_KEY]:  # greedy rollouts accept a draft alike however drawn
        return measured_prefix(record.get(ACCEPTANCE_KEY)), None
    by_sampling = record.get(BY_DRAFT_SAMPLING_KEY)
    if isinstance(by_sampling, dict) and run[DRAFT_SAMPLING_KEY] in by_sampling:
        return measured_prefix(by_sampling[run[DRAFT_SAMPLING_KEY]]), None
    return [], _other_sampling(DRAFT_SAMPLING_KEY, drafted, run)


def _other_sampling(key: str, recorded, run: dict) -> str:
    return (f"the starting drafter's held-out acceptance was measured at {RECORDED_AS[key]} {recorded} and this run "
            f"has {RECORDED_AS[key]} {run[key]}; acceptance moves with sampling, so that record does not judge it")
