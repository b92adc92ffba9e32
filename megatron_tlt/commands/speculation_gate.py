"""Whether a new run's engines speculate: a drafter that cannot repay what a speculating engine costs is not served.

A speculating vLLM engine runs its EAGLE drafter at every step, depth 0 included, so that the drafter's KV cache
stays whole for the steps that draft again (what makes switching depth safe). That cost is paid whatever depth the
bandit picks: on the CPU a speculating engine's depth-0 steps took 1.08-1.22x a plain engine's on SmolLM2-135M, and
it ran at 0.82x a plain engine's speed on the tiny default (bench/RESULTS.md). A drafter that speculation cannot make
pay (its ceiling, ``spec/ceiling.py``, below ``speculation.min_ceiling``) then only slows the rollout. Such a run
rolls out on plain engines (``drafter.depth`` 0 in its config.yaml, so a resumed run stays so) and still trains the
drafter on idle ranks where ``drafter.spot_training`` is on.

The judgement reads the held-out acceptance a cold start records with its drafter, at the depths the run may draft
(the bandit's arms, or drafter.depth alone without BEG-MAB). A drafter without such a record (a random start, a
spot-trained checkpoint, a user's own) is served as configured. The record is taken as it is: a drafter measured at
another temperature or draft sampling than the run's is judged on those figures. The ceiling assumes verifying is
free, so 1.1 is a bound on what can pay, not a measured break-even: a CPU pays for verification, and a ceiling above
1.1 there can still lose.
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


@dataclasses.dataclass(frozen=True)
class SpeculationVerdict:
    serve: bool
    """Whether the engines speculate with the drafter."""
    ceiling: SpeculationCeiling | None
    """The drafter's ceiling; None where its record measured no depth the run drafts."""
    min_ceiling: float

    def to_json(self) -> str:
        ceiling = self.ceiling
        return json.dumps({"serve": self.serve, "ceiling": ceiling.speedup if ceiling else None,
                           "ceiling_depth": ceiling.depth if ceiling else None,
                           "cost_share": ceiling.cost_share if ceiling else None, "min_ceiling": self.min_ceiling},
                          indent=1)

    def describe(self) -> str:
        if self.ceiling is None:
            return ("speculation: on as configured (the starting drafter records no held-out acceptance at the "
                    "depths this run drafts, to judge it by)")
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
    acceptance = measured_prefix(store.read_drafter_info(config.drafter.init_dir).get(ACCEPTANCE_KEY))
    ceiling = None
    if acceptance:
        ceiling = speculation_ceiling(acceptance, drafter_cost_share(arch), depths=usable_depths(config))
    if ceiling is None:  # nothing measured at a depth the run drafts: it cannot be judged
        return SpeculationVerdict(True, None, threshold)
    return SpeculationVerdict(ceiling.speedup >= threshold, ceiling, threshold)
