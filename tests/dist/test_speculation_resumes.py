"""Speculation that stops and starts again keeps its acceptance: requests that decoded through a stretch of
depth-0 steps (the bandit switching speculation off at a large batch, then on again in the tail) accept as
many drafts after it as requests that never stopped.

Peers lost acceptance here: a drafter that skips its forward while not drafting leaves its KV cache unwritten
for those positions, and every later draft that attends to them goes wrong (TensorRT-LLM #16888). vLLM 0.32's
EAGLE proposer runs its first pass at depth 0 for that reason; this guards it, and the control (the same engine
with that pass skipped) shows the measure would see the loss.

Uses ``tiny_models.previous_token_fixture``: a target whose next token depends on the previous token too, and a
drafter that predicts it exactly only while its KV cache holds the previous positions. Greedy throughout, so
the tokens are the same in every arm and every window's accepted count is exact.
"""

import pytest

from megatron_tlt.formats.architecture import architecture_from_dict
from megatron_tlt.launcher import run_on_ranks
from tiny_models import PREVIOUS_TOKEN_ROLLOUT, previous_token_fixture

K = 3
PROMPTS = [[i, i + 1] for i in range(1, 5)]
CONTROL_PROMPTS = [[i, i + 1] for i in range(11, 15)]  # never decoded before: no slot holds their tokens
RESPONSE_TOKENS = 96
STRETCH = (6, 30)  # engine steps [6, 30) at depth 0; the others at K


class _DepthByStep:
    """A depth policy that runs engine steps in ``STRETCH`` at depth 0 and every other step at K: the off-and-on
    a bandit makes when the batch shrinks into the tail, without depending on the batch."""

    def __init__(self):
        self.steps = 0

    def choose(self, batch_size: int, live=()) -> int:
        self.steps += 1
        return 0 if STRETCH[0] <= self.steps < STRETCH[1] else K

    def observe_step(self, batch_size: int, depth: int, tokens: int, seconds: float) -> None:
        """Learns nothing."""

    def observe_drafts(self, request_id: str, drafted: int, accepted: int) -> None:
        """Learns nothing."""

    def forget_requests_except(self, live) -> None:
        """Keeps no requests."""

    def rate(self, batch_size: int, depth: int) -> None:
        """Knows no rates (the rollout then has no speedup estimate)."""

    def summary(self) -> dict:
        return {}


def _skip_the_drafters_pass_at_depth_zero(worker) -> None:
    """The control: the drafter proposes nothing and runs no forward at depth 0 (the peers' bug)."""
    drafter = worker.model_runner.drafter
    propose = drafter.propose

    def propose_without_a_pass_at_zero(num_speculative_tokens, *args, **kwargs):
        if num_speculative_tokens == 0:
            import torch

            return torch.empty(kwargs["common_attn_metadata"].batch_size(), 0, dtype=torch.int64)
        return propose(num_speculative_tokens, *args, **kwargs)

    drafter.propose = propose_without_a_pass_at_zero


def _windows_after_the_stretch(result) -> dict[str, list[int]]:
    """Per request, the accepted count of each window verified after the last depth-0 step, but its last one
    (a request that reaches its token limit drafts no further)."""
    last_zero = max(i for i, depth in enumerate(result.step_depths) if depth == 0)
    windows: dict[str, list[int]] = {}
    for step in result.step_drafts[last_zero + 1:]:
        for request, accepted in step:
            windows.setdefault(request, []).append(accepted)
    return {request: counts[:-1] for request, counts in windows.items()}


def _every_window(result) -> list[int]:
    windows: dict[str, list[int]] = {}
    for step in result.step_drafts:
        for request, accepted in step:
            windows.setdefault(request, []).append(accepted)
    return [count for counts in windows.values() for count in counts[:-1]]


def _engine_on_rank(workdir: str) -> dict:
    from megatron_tlt.config import SpeculationConfig
    from megatron_tlt.parallel import ParallelLayout
    from megatron_tlt.spec.engine import RolloutEngine, RolloutEngineConfig, SamplingSettings, SpeculativeSettings

    arch = architecture_from_dict(PREVIOUS_TOKEN_ROLLOUT)
    fixture = previous_token_fixture(arch)
    bandit = SpeculationConfig(adaptive=True, bucket_bounds=[1, 4, 8], depths=[0, K], window=10, epsilon=0.0)
    greedy = SamplingSettings(temperature=0.0, max_tokens=RESPONSE_TOKENS)
    out = {}
    with ParallelLayout():
        engine = RolloutEngine(arch, RolloutEngineConfig(max_model_len=256, seed=0), workdir=workdir, rank=0,
                               speculative=SpeculativeSettings(num_speculative_tokens=K, adaptive=bandit, seed=0),
                               drafter=fixture["drafter"])
        try:
            engine.load_weights(fixture["target"].items())
            scheduler = engine.adaptive_scheduler()
            scheduler.bandit = _DepthByStep()
            stopped = engine.generate(PROMPTS, greedy)
            out["stopped_depths"] = stopped.step_depths
            out["stopped_after"] = _windows_after_the_stretch(stopped)
            out["stopped_tokens"] = [r[0] for r in stopped.token_ids]
            scheduler.pin_depth(K)
            never = engine.generate(PROMPTS, greedy)
            out["never_windows"] = _every_window(never)
            out["never_tokens"] = [r[0] for r in never.token_ids]
            scheduler.pin_depth(None)
            engine._llm.collective_rpc(_skip_the_drafters_pass_at_depth_zero)
            scheduler.bandit = _DepthByStep()
            control = engine.generate(CONTROL_PROMPTS, greedy)
            out["control_after"] = _windows_after_the_stretch(control)
        finally:
            engine.close()
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    return run_on_ranks(_engine_on_rank, 1, str(tmp_path_factory.mktemp("resume")), isolated=True)[0]


def test_the_drafter_is_exact_while_its_cache_is_whole(resumed):
    # the fixture's premise: never stopping, every window is accepted whole
    assert len(resumed["never_windows"]) >= 4 * 15
    assert set(resumed["never_windows"]) == {K}, resumed["never_windows"]


def test_the_stretch_ran_at_depth_zero_and_then_speculated_again(resumed):
    depths = resumed["stopped_depths"]
    assert depths[:STRETCH[0] - 1] == [K] * (STRETCH[0] - 1)
    assert set(depths[STRETCH[0]:STRETCH[1]]) == {0}  # a change of depth runs two steps: one late step
    assert depths[-1] == K
    assert resumed["stopped_tokens"] == resumed["never_tokens"]  # lossless whatever the depth


def test_requests_accept_every_draft_after_a_stretch_at_depth_zero(resumed):
    after = resumed["stopped_after"]
    assert len(after) == len(PROMPTS) and all(len(windows) >= 10 for windows in after.values()), after
    assert {count for windows in after.values() for count in windows} == {K}, after


def test_a_drafter_that_skipped_its_pass_at_depth_zero_would_lose_drafts(resumed):
    # the control: the measure above sees a cache left unwritten through the stretch
    first_windows = [windows[0] for windows in resumed["control_after"].values()]
    assert len(first_windows) == len(CONTROL_PROMPTS)
    assert sum(first_windows) < K * len(first_windows), resumed["control_after"]
