"""Whether a new run's engines speculate: a drafter that cannot repay what a speculating engine costs is not served.

A speculating vLLM engine runs its EAGLE drafter at every step, depth 0 included, so that the drafter's KV cache
stays whole for the steps that draft again (what makes switching depth safe). That cost is paid whatever depth the
bandit picks: on 2 CPU cores a speculating engine at depth 0 ran at 0.82x a plain engine's speed on the tiny
default (bench/RESULTS.md). A drafter that speculation cannot make pay (its ceiling, ``spec/ceiling.py``, below
``speculation.min_ceiling``) then only slows the rollout. Such a run rolls out on plain engines (``drafter.depth``
0, written into its config.yaml, so a resumed run stays so) and still trains the drafter on idle ranks where
``drafter.spot_training`` is on. The judgement reads the held-out acceptance a cold start records with its drafter;
a drafter without one (a random start, a user's own) is served as configured.
"""

from __future__ import annotations

import dataclasses
import json
import math

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
    """The drafter's ceiling; None where its directory records no held-out acceptance."""
    min_ceiling: float

    def to_json(self) -> str:
        ceiling = self.ceiling
        return json.dumps({"serve": self.serve, "ceiling": ceiling.speedup if ceiling else None,
                           "ceiling_depth": ceiling.depth if ceiling else None,
                           "cost_share": ceiling.cost_share if ceiling else None, "min_ceiling": self.min_ceiling},
                          indent=1)

    def describe(self) -> str:
        if self.ceiling is None:
            return ("speculation: on as configured (the starting drafter records no held-out acceptance to judge it "
                    "by)")
        if self.serve:
            return (f"speculation: on; the starting drafter's ceiling {self.ceiling.speedup:.2f}x reaches "
                    f"speculation.min_ceiling {self.min_ceiling:g}")
        return (f"speculation: OFF for this run: the starting drafter can make rollouts at most "
                f"{self.ceiling.speedup:.2f}x faster (its held-out acceptance, verifying free), below "
                f"speculation.min_ceiling {self.min_ceiling:g}, and a speculating engine runs its drafter at every "
                f"step; the engines roll out without drafts (drafter.depth 0 in the run's config.yaml) and the "
                f"drafter still trains on idle ranks if drafter.spot_training is on. speculation.min_ceiling=0 "
                f"speculates anyway (docs/tlt.md)")


def judge(config: TLTConfig, arch: PolicyArchitecture) -> SpeculationVerdict:
    """The verdict on the drafter ``drafter.init_dir`` holds for a run of ``config`` on a policy of ``arch``."""
    threshold = config.speculation.min_ceiling
    acceptance = store.read_drafter_info(config.drafter.init_dir).get(ACCEPTANCE_KEY)
    if not acceptance or not all(math.isfinite(a) for a in acceptance):  # NaN: no held-out chain long enough
        return SpeculationVerdict(True, None, threshold)
    # at the depths this run's engines may draft (the cold start measures to its own eval_depth)
    ceiling = speculation_ceiling(acceptance[:config.drafter.depth], drafter_cost_share(arch))
    return SpeculationVerdict(ceiling.speedup >= threshold, ceiling, threshold)
