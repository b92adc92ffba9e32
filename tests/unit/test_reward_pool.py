"""The reward pool on a real Ray instance (one for the module: Ray takes seconds to start): time-outs,
crashed and raising workers, and rewards identical to inline scoring on the default task's responses."""

import collections
import logging
import os
import random
from pathlib import Path

import pytest

from megatron_tlt.rl.rewards import ray_cluster
from megatron_tlt.rl.rewards.functions import exact_match_reward
from megatron_tlt.rl.rewards.pool import RewardPool, Score, StreamedScores
from megatron_tlt.rl.tiny import synthetic_task

HELPERS = Path(__file__).parent / "helpers"
REWARD = "faulty_rewards:misbehaving"
# Long enough that a response scored normally never runs out of time on a loaded 2-core machine.
TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def ray_instance():
    """A private Ray instance whose workers import tests/unit/helpers (they inherit this environment)."""
    import ray

    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HELPERS), previous]))
    try:
        ray_cluster.start_local_ray(num_cpus=4)
    finally:
        if previous is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = previous
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def shared_pool(ray_instance):
    """One pool for the tests of failures (a worker takes seconds to start): each reads its own counts."""
    pool = RewardPool(REWARD, workers=2, timeout_s=TIMEOUT_S, failure_value=-1.0)
    yield pool
    pool.close()


class _Counted:
    """The shared pool, with what it counted since the test began."""

    def __init__(self, pool: RewardPool):
        self.pool, self._failures, self._replaced = pool, collections.Counter(pool.failures), pool.replaced

    @property
    def failures(self) -> dict[str, int]:
        return dict(self.pool.failures - self._failures)

    @property
    def replaced(self) -> int:
        return self.pool.replaced - self._replaced


@pytest.fixture
def pool(shared_pool):
    return _Counted(shared_pool)


def _score_all(counted: _Counted, items: list[tuple[str, str]]) -> list[Score]:
    pool = counted.pool
    return pool.scores([pool.submit(text, truth, label=f"item {i}") for i, (text, truth) in enumerate(items)])


GOOD = [("x\n#### 7", "7"), ("x\n#### 8", "7"), ("The answer is 7", "7")]


def test_a_reward_that_runs_past_the_time_out_gets_the_failure_value_and_its_worker_is_replaced(pool, caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_tlt.rl.rewards.pool"):
        scores = _score_all(pool, [("hang", "7"), *GOOD])
    assert scores == [Score(-1.0, "timeout", f"no reward after {TIMEOUT_S:g} s"), Score(1.0), Score(0.0), Score(0.0)]
    assert "reward of item 0: no reward after 5 s; it gets -1; its worker is replaced" in caplog.text
    assert pool.failures == {"timeout": 1} and pool.replaced == 1
    # the replacement scores: both workers are busy with a response each at once, none is lost
    assert _score_all(pool, GOOD * 2) == [Score(1.0), Score(0.0), Score(0.0)] * 2


def test_a_worker_that_dies_mid_response_is_replaced_and_the_run_goes_on(pool, caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_tlt.rl.rewards.pool"):
        scores = _score_all(pool, [*GOOD, ("crash", "7"), *GOOD])
    assert scores[:3] == scores[4:] == [Score(1.0), Score(0.0), Score(0.0)]
    crashed = scores[3]
    assert (crashed.reward, crashed.failure) == (-1.0, "worker_crash")
    assert crashed.reason.startswith("its worker died (") and "item 3" in caplog.text
    assert pool.failures == {"worker_crash": 1} and pool.replaced == 1
    assert _score_all(pool, GOOD) == [Score(1.0), Score(0.0), Score(0.0)]


def test_a_reward_that_raises_gets_the_failure_value_and_keeps_its_worker(pool):
    scores = _score_all(pool, [("raise", "7"), *GOOD])
    assert (scores[0].reward, scores[0].failure) == (-1.0, "error")
    assert "ValueError: cannot parse this response" in scores[0].reason
    assert scores[1:] == [Score(1.0), Score(0.0), Score(0.0)]
    assert pool.failures == {"error": 1} and pool.replaced == 0


def test_the_pool_gives_the_default_tasks_responses_the_same_rewards_as_inline_scoring(ray_instance, tmp_path):
    """Responses as the engine hands them over (token ids, prompt by prompt, in the order they finish), decoded
    with the default task's tokenizer: right, wrong, in the other answer format, cut short."""
    from megatron_tlt.formats.tokenizer import load_tokenizer
    from megatron_tlt.rl.tiny import tiny_default

    tokenizer = load_tokenizer(tiny_default.ensure_tokenizer(tmp_path / "tokenizer"))
    problems = synthetic_task.generate_problems(24, seed=3)
    rng = random.Random(0)

    def variants(problem: synthetic_task.Problem) -> list[str]:
        wrong = problem.solution.rsplit(" ", 1)[0] + f" {int(problem.answer) + 1}"
        return [problem.solution, synthetic_task.with_other_answer_format(problem.solution), wrong,
                problem.solution[: len(problem.solution) // 2]]

    responses = [[tokenizer.encode(text) for text in variants(p)] for p in problems]
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731 (as the trainer decodes)
    inline = [[exact_match_reward(decode(ids), p.answer) for ids in group] for p, group in zip(problems, responses)]

    pool = RewardPool("exact_match", workers=2, timeout_s=60.0)
    try:
        streamed = StreamedScores(pool, decode, [p.answer for p in problems])
        for k in rng.sample(range(len(problems)), len(problems)):
            streamed.on_finished(k, responses[k])
        pooled = [[s.reward for s in group] for group in streamed.scores()]
    finally:
        pool.close()
    assert pooled == inline
    assert {r for group in inline for r in group} == {0.0, 1.0} and not streamed.failures
