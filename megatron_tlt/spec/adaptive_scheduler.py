"""The hook of adaptive depth into vLLM: a scheduler class that sets the speculation depth of every engine step.

vLLM 0.32's scheduler already carries a per-step depth (``SchedulerOutput.num_spec_tokens_to_schedule``,
read by the model runner; 0 turns drafting off for that step) when dynamic speculative decoding is on.
This subclass, given to vLLM by qualified name (``scheduler_cls``), sets that depth from its depth policy,
``speculation.policy``: BEG-MAB (``spec/bandit.py``, from the live batch size) or the goodput model
(``spec/goodput.py``, from the live requests), and feeds it each step's outcome in ``update_from_output``:
the step's time and tokens, and every request's drafts and how many of them were accepted. Nothing of vLLM is
forked or patched. Settings arrive through ``additional_config[BANDIT_CONFIG_KEY]``, a plain
dict (vLLM hashes it as JSON): ``speculation.*`` as ``dataclasses.asdict`` gives it, plus the
bandit's ``seed`` (``bandit_additional_config`` writes it, ``bandit_from_additional_config`` reads it).
In an engine over several ranks the first rank's bandit chooses and the others follow it.

Credit assignment: step N verifies the drafts proposed at the end of step N-1 (depth K_{N-1}) and
drafts K_N new ones, so its tokens come from K_{N-1} and its time holds the drafting of K_N. Only steps
with K_{N-1} == K_N measure one depth cleanly, and only those are credited; a change of depth is held
for two steps so that the second one is such a step. Steps that prefill (new or resumed prompts) are
not credited either: their time is not decoding's.
Reward = tokens the step produced (accepted drafts + one per sequence) / the step's wall time, i.e.
accepted tokens x batch size / step time. The step's time runs from its ``schedule`` to the next one, so
it holds all the engine does per step (model, drafter, sampling, output processing); the last step of
a ``generate`` call has no next one in that call and is not credited.
"""

from __future__ import annotations

import dataclasses
import time

from vllm.distributed.parallel_state import get_tp_group
from vllm.v1.core.sched.scheduler import Scheduler

from megatron_tlt.config import SpeculationConfig
from megatron_tlt.spec.bandit import BucketedEpsilonGreedy
from megatron_tlt.spec.goodput import GoodputDepthModel

BANDIT_CONFIG_KEY = "tlt_speculation_bandit"
QUALIFIED_NAME = f"{__name__}.AdaptiveSpeculationScheduler"


def bandit_additional_config(settings: SpeculationConfig, seed: int) -> dict:
    """vLLM's ``additional_config`` entry that carries the bandit's settings and seed to the scheduler."""
    return {BANDIT_CONFIG_KEY: {**dataclasses.asdict(settings), "seed": seed}}


def depth_policy_for(settings: SpeculationConfig, max_depth: int, seed: int = 0):
    """The depth policy ``settings.policy`` names, over depths up to the engine's ``max_depth``."""
    policy = GoodputDepthModel if settings.policy == GoodputDepthModel.kind else BucketedEpsilonGreedy
    return policy(settings, max_depth=max_depth, seed=seed)


def bandit_from_additional_config(additional_config: dict | None, max_depth: int):
    """The depth policy ``bandit_additional_config`` described, over depths up to the engine's ``max_depth``."""
    fields = dict((additional_config or {}).get(BANDIT_CONFIG_KEY, {}))
    seed = fields.pop("seed", 0)
    return depth_policy_for(SpeculationConfig(**fields), max_depth, seed)


@dataclasses.dataclass
class _StepInFlight:
    started: float
    batch_size: int
    depth: int
    decode_only: bool


class AdaptiveSpeculationScheduler(Scheduler):
    """vLLM's scheduler with the speculation depth of each step chosen by its depth policy (or pinned)."""

    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        if self.dynamic_sd_lookup is None:
            raise ValueError("AdaptiveSpeculationScheduler needs speculative decoding with "
                             "num_speculative_tokens_per_batch_size set (dynamic speculation on)")
        self.bandit = bandit_from_additional_config(vllm_config.additional_config, self.num_spec_tokens)
        """The depth policy: BEG-MAB or the goodput model (``speculation.policy``)."""
        self.pinned_depth: int | None = None
        """A fixed depth for every step instead of the policy's choice (the acceptance probe's full depth, a
        suspended drafter's 0, a benchmark's fixed depth); None: the policy."""
        self.step_log: list[tuple[int, int]] = []
        """(batch size, depth) of every step since the engine last drained it."""
        self.draft_log: list[list[tuple[str, int]]] = []
        """Per step since the engine last drained it: (request, drafts accepted) of each request whose drafts the
        step verified (``RolloutResult.step_drafts``; ``bench/depth_headroom.py`` reads a rollout's at the deepest
        depth)."""
        self._in_flight: _StepInFlight | None = None
        self._previous_depth: int | None = None  # of the drafts the next step verifies
        self._held_depth: int | None = None  # a new depth runs a second step, to be measured cleanly
        self._unclocked: tuple | None = None  # (batch, depth, tokens, start) of a clean step
        self.clock = time.perf_counter
        """What times a step; a test gives a step counter instead, so that every reward is exact."""

    def pin_depth(self, depth: int | None) -> None:
        if depth is not None and not 0 <= depth <= self.num_spec_tokens:
            raise ValueError(f"depth {depth} outside 0..{self.num_spec_tokens} (the engine's maximum)")
        self.pinned_depth = depth

    @property
    def pinned(self) -> bool:
        """Whether the depth is pinned (the policy then neither chooses nor learns)."""
        return self.pinned_depth is not None

    def schedule(self, *args, **kwargs):
        started = self.clock()
        if self._unclocked is not None:  # the previous step ends here: credit it
            batch_size, depth, tokens, step_started = self._unclocked
            self._unclocked = None
            self.bandit.observe_step(batch_size, depth, tokens, started - step_started)
        output = super().schedule(*args, **kwargs)
        batch_size = len(output.num_scheduled_tokens)
        if batch_size == 0:
            return output
        live = list(output.num_scheduled_tokens)
        self.bandit.forget_requests_except(live)
        output.num_spec_tokens_to_schedule = depth = self._depth_for(batch_size, live)
        spec = output.scheduled_spec_decode_tokens
        decode_only = not output.scheduled_new_reqs and all(
            tokens == 1 + len(spec.get(req_id, ())) for req_id, tokens in output.num_scheduled_tokens.items())
        self._in_flight = _StepInFlight(started, batch_size, depth, decode_only)
        self.step_log.append((batch_size, depth))
        return output

    def _depth_for(self, batch_size: int, live: list[str]) -> int:
        if self.pinned_depth is not None:  # pinned alike on every rank by the caller
            return self.pinned_depth
        tp_group = get_tp_group()
        if tp_group.world_size == 1:
            return self._bandit_depth(batch_size, live)
        # Every rank of a tensor-parallel engine runs its own scheduler, and they must agree on every
        # step (external_launcher's premise); rewards are timed per rank, so the first rank decides.
        return tp_group.broadcast_object(
            self._bandit_depth(batch_size, live) if tp_group.rank_in_group == 0 else None)

    def _bandit_depth(self, batch_size: int, live: list[str]) -> int:
        if self._held_depth is not None:
            depth, self._held_depth = self._held_depth, None
            return depth
        depth = self.bandit.choose(batch_size, live)
        if depth != self._previous_depth:
            self._held_depth = depth
        return depth

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        step, self._in_flight = self._in_flight, None
        if step is None:
            return outputs
        outcomes = self._observe_drafts(scheduler_output, model_runner_output)
        self.draft_log.append(outcomes)
        clean = step.decode_only and step.depth == self._previous_depth
        # pinned steps are not the bandit's choices: they would skew its pull counts
        if clean and not self.pinned and self.get_num_unfinished_requests() > 0:
            tokens = sum(len(ids) for ids in model_runner_output.sampled_token_ids or ())
            self._unclocked = (step.batch_size, step.depth, tokens, step.started)
        self._previous_depth = step.depth
        return outputs

    def _observe_drafts(self, scheduler_output, model_runner_output) -> list[tuple[str, int]]:
        """Each request's drafts verified in this step and how many were accepted (as vLLM's own stats count);
        returns (request, accepted) per request that drafted."""
        sampled = model_runner_output.sampled_token_ids
        if not sampled:
            return []
        index = model_runner_output.req_id_to_index
        outcomes = []
        for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            if drafts and req_id in index:
                accepted = max(len(sampled[index[req_id]]) - 1, 0)
                outcomes.append((req_id, accepted))
                self.bandit.observe_drafts(req_id, len(drafts), accepted)
        return outcomes

    def drain_step_log(self) -> list[tuple[int, int]]:
        log, self.step_log = self.step_log, []
        return log

    def drain_draft_log(self) -> list[list[tuple[str, int]]]:
        log, self.draft_log = self.draft_log, []
        return log
