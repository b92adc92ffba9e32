"""The tiny default's synthetic task: determinism, correct worked solutions, a long tail of lengths, and a
sentencepiece tokenizer trained on its text that round-trips it and fits the longest problem in 256 tokens."""

import re
from dataclasses import FrozenInstanceError

import pytest

from megatron_tlt.formats.tokenizer import load_tokenizer, train_sentencepiece
from megatron_tlt.rl.tiny.synthetic_task import (
    ANSWER_MARKER,
    OTHER_ANSWER_PREFIX,
    PROMPT_SUFFIX,
    Problem,
    extract_answer,
    generate_problems,
    is_correct,
    length_stats,
    solve,
    task_corpus,
    with_checks,
    with_other_answer_format,
)

NUM_PROBLEMS = 2000
CONTEXT_TOKENS = 256


@pytest.fixture(scope="module")
def problems():
    return generate_problems(NUM_PROBLEMS, seed=1)


@pytest.fixture(scope="module")
def task_tokenizer(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("task_sp")
    train_sentencepiece(task_corpus(NUM_PROBLEMS, seed=0), out_dir, vocab_size=320)
    return load_tokenizer(out_dir)


def evaluate_independently(prompt: str) -> int:
    """Read the expression between "Q: " and "=?" and let Python evaluate it (+ and - group left to right)."""
    expression = re.fullmatch(r"Q: ([0-9+-]+)=\?\nA:", prompt).group(1)
    return eval(expression)  # digits and +/- only, checked by the regex above


def test_the_same_seed_gives_the_same_problems_and_another_seed_different_ones():
    assert generate_problems(300, seed=7) == generate_problems(300, seed=7)
    assert generate_problems(300, seed=7) != generate_problems(300, seed=8)
    assert task_corpus(50, seed=3) == task_corpus(50, seed=3)


def test_problems_are_frozen():
    problem = generate_problems(1, seed=0)[0]
    with pytest.raises(FrozenInstanceError):
        problem.answer = "0"


def test_every_answer_is_the_value_of_the_expression_in_the_prompt(problems):
    for problem in problems:
        expected = evaluate_independently(problem.prompt)
        assert problem.answer == str(expected)
        assert solve(problem.prompt) == problem.answer


def test_every_solution_line_is_one_correct_step_that_starts_from_the_previous_result(problems):
    for problem in problems:
        assert problem.prompt.endswith(PROMPT_SUFFIX)
        assert problem.solution.startswith(" ")  # "A:" then a space, as a model would write it
        *step_lines, answer_line = problem.solution[1:].split("\n")
        assert len(step_lines) == problem.num_steps
        assert answer_line == f"{ANSWER_MARKER} {problem.answer}"
        previous = None
        for line in step_lines:
            left, result = line.split("=")
            assert eval(left) == int(result)  # digits and one +/- only
            assert 0 <= int(result) <= 99
            start = int(re.match(r"\d+", left).group())
            assert previous is None or start == previous
            previous = int(result)
        assert str(previous) == problem.answer


def test_the_answer_is_extracted_from_the_text_after_the_last_marker(problems):
    for problem in problems[:200]:
        assert problem.solution.count(ANSWER_MARKER) == 1
        assert extract_answer(problem.solution) == problem.answer
        assert is_correct(problem.prompt, problem.solution)
    assert extract_answer("12+3=15\n#### 14\n#### 15 \n") == "15"
    assert extract_answer("12+3=15") is None
    assert not is_correct("Q: 12+3=?\nA:", " 12+3=15\n#### 14")


def test_the_other_answer_format_keeps_the_work_and_is_not_read_by_the_reward(problems):
    for problem in problems[:200]:
        other = with_other_answer_format(problem.solution)
        assert other.endswith(f"\n{OTHER_ANSWER_PREFIX}{problem.answer}")
        assert other.rsplit("\n", 1)[0] == problem.solution.rsplit("\n", 1)[0]  # same worked lines
        assert extract_answer(other) is None and not is_correct(problem.prompt, other)
    with pytest.raises(ValueError, match="not a worked solution"):
        with_other_answer_format("12+3=15")


def test_the_tokenizer_corpus_holds_both_answer_formats():
    corpus = task_corpus(10, seed=0)
    assert sum(ANSWER_MARKER in text for text in corpus) == 5
    assert sum(OTHER_ANSWER_PREFIX in text for text in corpus) == 5


def test_solve_rejects_text_that_is_not_a_task_prompt():
    with pytest.raises(ValueError, match="not a synthetic-task prompt"):
        solve("What is 2+2?")


def test_solution_lengths_have_a_long_tail_while_most_problems_are_short(problems):
    stats = length_stats(problems)
    # Measured at seed 1, 2000 problems, defaults (max_steps=20, tail=1.5): chars mean 34.8,
    # median 24, p90 80, max 168; steps median 2, p90 9, max 20 (p90/median 3.3, max/median 7.0).
    assert stats["median_steps"] <= 3
    assert stats["p90_chars"] / stats["median_chars"] >= 2
    assert stats["max_chars"] / stats["median_chars"] >= 5
    assert stats["max_steps"] >= 15
    assert sum(p.num_steps <= 3 for p in problems) / len(problems) >= 0.6  # measured 0.73


def test_a_heavier_tail_setting_gives_longer_problems():
    light = length_stats(generate_problems(NUM_PROBLEMS, seed=1, tail=3.0))
    heavy = length_stats(generate_problems(NUM_PROBLEMS, seed=1, tail=1.0))
    assert heavy["mean_steps"] > light["mean_steps"]
    assert max(p.num_steps for p in generate_problems(200, seed=1, max_steps=4)) <= 4


def test_bad_generation_arguments_are_rejected_with_their_name():
    with pytest.raises(ValueError, match="max_steps"):
        generate_problems(1, seed=0, max_steps=0)
    with pytest.raises(ValueError, match="tail"):
        generate_problems(1, seed=0, tail=0.0)


def test_a_tokenizer_trained_on_the_task_round_trips_prompts_and_solutions(problems, task_tokenizer):
    assert task_tokenizer.vocab_size <= 320
    for problem in problems[:300]:
        text = problem.prompt + problem.solution
        assert task_tokenizer.decode(task_tokenizer.encode(text)) == text
        assert task_tokenizer.decode(task_tokenizer.encode(problem.solution)) == problem.solution
        # The prompt's tokens are a prefix of the full text's, so the solution's tokens are well defined.
        prompt_ids = task_tokenizer.encode(problem.prompt)
        assert task_tokenizer.encode(text)[: len(prompt_ids)] == prompt_ids


def test_the_longest_problem_fits_in_the_context_with_bos_and_eos(problems, task_tokenizer):
    stats = length_stats(problems, task_tokenizer)
    # Measured (seed 1, 2000 problems, vocab 290 pieces): solution tokens mean 30.8, median 20, p90 76,
    # max 164; the longest prompt + solution is 212 tokens, 214 with BOS and EOS.
    assert stats["max_total_tokens"] + 2 <= CONTEXT_TOKENS
    assert stats["p90_tokens"] / stats["median_tokens"] >= 2
    assert stats["max_tokens"] / stats["median_tokens"] >= 5
    longest = max(problems, key=lambda p: len(p.solution))
    assert len(task_tokenizer.encode(longest.prompt + longest.solution, add_bos=True)) + 1 <= CONTEXT_TOKENS


def test_the_problem_record_holds_prompt_solution_answer_and_steps():
    problem = generate_problems(1, seed=0)[0]
    assert isinstance(problem, Problem)
    assert problem.prompt.startswith("Q: ")
    assert problem.num_steps >= 1


def test_the_warmup_corpus_states_the_configured_share_of_answers_in_the_other_format(task_tokenizer):
    from megatron_tlt.rl.tiny.tiny_default import warmup_sequences

    mixed = warmup_sequences(task_tokenizer, 400, other_answer_format_share=0.35)
    assert mixed == warmup_sequences(task_tokenizer, 400, other_answer_format_share=0.35)  # seeded
    solutions = [task_tokenizer.decode(ids[prompt_len:], skip_special_tokens=True) for ids, prompt_len in mixed]
    other = sum(OTHER_ANSWER_PREFIX.strip() in text for text in solutions)
    assert 0.28 * 400 < other < 0.42 * 400
    assert all((ANSWER_MARKER in text) != (OTHER_ANSWER_PREFIX.strip() in text) for text in solutions)
    assert all(ids[-1] == task_tokenizer.eos_id for ids, _ in mixed)
    plain = warmup_sequences(task_tokenizer, 400)
    assert not any(OTHER_ANSWER_PREFIX.strip() in task_tokenizer.decode(ids[p:], skip_special_tokens=True)
                   for ids, p in plain)


def test_a_check_restates_the_question_and_repeats_the_work_leaving_the_answer_as_it_was(problems):
    problem = next(p for p in problems if p.num_steps == 3)
    assert with_checks(problem, 0) == problem.solution
    checked = with_checks(problem, 2)
    lines = problem.solution.lstrip(" ").split("\n")
    work, answer_line = lines[:-1], lines[-1]
    question = problem.prompt.removeprefix("Q: ").removesuffix("\nA:")
    assert question.endswith("=?")
    assert checked.lstrip(" ").split("\n") == work + [question, *work] + [question, *work] + [answer_line]
    assert extract_answer(checked) == problem.answer
    assert is_correct(problem.prompt, with_other_answer_format(checked)) is False  # "The answer is": not read
    with pytest.raises(ValueError, match="num_checks must be >= 0"):
        with_checks(problem, -1)


def _num_checks(text: str) -> int:
    return text.count("=?")


def test_the_warmup_corpus_checks_at_the_configured_rate_within_the_response_budget(task_tokenizer):
    from megatron_tlt.rl.tiny.tiny_default import warmup_sequences

    plain = warmup_sequences(task_tokenizer, 2000, other_answer_format_share=0.35)
    checked = warmup_sequences(task_tokenizer, 2000, other_answer_format_share=0.35, check_share=0.25)
    assert checked == warmup_sequences(task_tokenizer, 2000, other_answer_format_share=0.35, check_share=0.25)
    texts = [task_tokenizer.decode(ids[p:], skip_special_tokens=True) for ids, p in checked]
    counts = [_num_checks(text) for text in texts]
    # P(at least one check) = 0.25, P(at least two) = 0.0625: binomial bounds of about 4 SD over 2000
    assert 0.21 * 2000 < sum(c >= 1 for c in counts) < 0.29 * 2000
    assert 0.04 * 2000 < sum(c >= 2 for c in counts) < 0.085 * 2000
    # the checks take their own random stream: each problem keeps the prompt and answer format it had
    plain_texts = [task_tokenizer.decode(ids[p:], skip_special_tokens=True) for ids, p in plain]
    assert [ids[:p] for ids, p in checked] == [ids[:p] for ids, p in plain]
    assert [ANSWER_MARKER in t for t in texts] == [ANSWER_MARKER in t for t in plain_texts]
    assert all(t == u for t, u, c in zip(texts, plain_texts, counts) if c == 0)
    # a budget leaves out the checks that would not fit, never the work or the answer
    budget = 120
    bounded = warmup_sequences(task_tokenizer, 2000, other_answer_format_share=0.35, check_share=0.25,
                               max_solution_tokens=budget)
    for (ids, p), (full_ids, _), (plain_ids, _) in zip(bounded, checked, plain):
        assert len(ids) - p <= budget or ids == plain_ids  # over budget only where no check was left
        assert len(ids) <= len(full_ids)
    assert sum(b != c for b, c in zip(bounded, checked)) > 0  # the budget did bind somewhere
