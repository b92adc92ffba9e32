"""What goes into the rollout engine and what comes out of it: the settings of a rollout call and of speculation,
a rollout's result, and the engine's error. Plain data, no vLLM: ``spec/engine.py`` re-exports them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from megatron_tlt.config import SpeculationConfig
from megatron_tlt.spec.metrics import SpecDecodeStats


class EngineError(RuntimeError):
    """The rollout engine could not start or serve a request; the message says why."""


@dataclasses.dataclass(kw_only=True)
class SamplingSettings:
    """The RL sampling settings for one rollout call."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop_token_ids: Sequence[int] = ()
    seed: int | None = None
    """Base seed; request i uses seed + i so a rollout is reproducible."""
    logprobs: bool = False
    """Return each sampled token's log-probability under the engine's policy (``RolloutResult.logprobs``): the RL
    rollout asks for them, and the trainer checks the engine against its own recomputation every step
    (``rl/rollout_agreement.py``)."""


@dataclasses.dataclass
class SpeculativeSettings:
    """EAGLE speculative decoding in the engine."""

    num_speculative_tokens: int = 3
    """Draft depth K (the most tokens proposed per step)."""
    adaptive: SpeculationConfig | None = None
    """BEG-MAB picks the depth of every engine step among ``adaptive.arms(num_speculative_tokens)``
    (the config's ``speculation`` section); None: always K. Its ``adaptive`` flag is not read here."""
    seed: int = 0
    """Seed of the bandit's exploration (``trainer.seed`` in a run)."""
    acceptance_alarm_threshold: float = 0.05
    """Accepted share of draft tokens below which a rollout or probe raises the collapse alarm."""
    draft_sampling: str = "probabilistic"
    """vLLM's ``draft_sample_method`` (``speculation.draft_sampling``): draft tokens drawn from the drafter's
    distribution, or its argmax."""


@dataclasses.dataclass
class RolloutResult:
    """Responses of one rollout call, in prompt order, n per prompt."""

    token_ids: list[list[list[int]]]
    finish_reasons: list[list[str]]
    seconds: float
    logprobs: list[list[list[float]]] | None = None
    """Per response, log p(token) of each sampled token under the engine's policy, before temperature and top-p
    (vLLM's ``raw_logprobs``; the target's under speculation, never the drafter's); None when not asked for."""
    spec: SpecDecodeStats = dataclasses.field(default_factory=SpecDecodeStats)
    step_batch_sizes: list[int] = dataclasses.field(default_factory=list)
    """Sequences in flight at each engine step (the long tail shows as a falling count)."""
    step_seconds: list[float] = dataclasses.field(default_factory=list)
    """Wall time of each engine step."""
    step_started_at: list[float] = dataclasses.field(default_factory=list)
    """Wall-clock start (``time.time()``, comparable across the ranks of a node, as the timeline's spans) of each
    engine step: places a step against other ranks' drafter training (``drafter/neighbour_slowdown.py``)."""
    step_depths: list[int] = dataclasses.field(default_factory=list)
    """Speculation depth of each engine step where BEG-MAB chooses it (else empty)."""
    step_drafts: list[list[tuple[str, int]]] = dataclasses.field(default_factory=list)
    """Per engine step of an engine with adaptive speculation (chosen or pinned; else empty): (request, drafts
    accepted) of each request whose drafts the step verified (``bench/depth_headroom.py`` traces them)."""
    speedup_estimate: float | None = None
    """This rollout's time at depth 0 / its time, from the depth policy's rates (``spec/speedup_estimate.py``);
    None without adaptive speculation or where the policy knows too few rates."""

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(r) for prompt in self.token_ids for r in prompt)
