"""The tiny default's task: evaluate a chain of small additions and subtractions, one line per step.

Shipped as code, nothing downloaded. A problem is a start value and ``k`` operations; its prompt ends
where the model starts writing, and its worked solution evaluates left to right, one short line per
step, then states the answer after the marker ``####``::

    Q: 55+1-8-5=?
    A: 55+1=56
    56-8=48
    48-5=43
    #### 43

Why this shape (DESIGN.md sections 1, 4, 5):
- A one-layer drafter can learn the reasoning text: each line starts by copying the previous result,
  then copies the next operation from the prompt, and only the new result needs arithmetic.
- The response length grows linearly with ``k``, and ``k`` follows a truncated Zipf law: most problems
  take 1-3 steps, a few take 10-20, so RL rollouts have the long tail of lengths TLT exploits.
- Every value stays in 0..99 and every operand in 1..9, so a model of a few M parameters can learn it;
  no spaces inside a line, so the longest problem (20 steps) fits in 256 tokens of a digit-split
  sentencepiece vocabulary, prompt and BOS/EOS included.

The reward (``rl/rewards/functions.py``) takes the first line after the last ``####``, stripped, and compares it with
``Problem.answer`` exactly; ``extract_answer`` here is that same rule (``rl.rewards``). Some warm-up
demonstrations end ``The answer is 43`` instead (``with_other_answer_format``), which that rule does not
read: the format RL then teaches. Some others check their work (``with_checks``): they restate the question
and work it again before the answer line, so a few samples of a group run two or three times as long as
the rest, as reasoning models re-verify: a long tail of lengths within each group, not only across them.
"""

from __future__ import annotations

import math
import random
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

from megatron_tlt import config
from megatron_tlt.config.sections import SolutionStyle

ANSWER_MARKER = "####"
OTHER_ANSWER_PREFIX = "The answer is "
"""How some worked solutions state the answer instead: text the reward's ``####`` rule does not read."""
PROMPT_PREFIX = "Q: "
QUESTION_END = "=?"  # ends the expression, in the prompt and where a check restates it
PROMPT_SUFFIX = QUESTION_END + "\nA:"  # the prompt ends here; the model writes the solution next
MAX_VALUE = 99  # every start value, intermediate and answer lies in 0..MAX_VALUE
MAX_OPERAND = 9  # every operand lies in 1..MAX_OPERAND
# The task's default shape is the config's (data.max_solution_steps, data.length_tail): one truth for both.
DEFAULT_MAX_STEPS = config.DataConfig.max_solution_steps
DEFAULT_TAIL = config.DataConfig.length_tail

_PROMPT_RE = re.compile(rf"^{re.escape(PROMPT_PREFIX)}(\d+)((?:[+-]\d+)+){re.escape(PROMPT_SUFFIX)}$")
_OPERATION_RE = re.compile(r"([+-])(\d+)")


@dataclass(frozen=True)
class Problem:
    """One problem: ``prompt + solution`` is the full worked text; ``answer`` is what follows the marker."""

    prompt: str
    """Ends with ``PROMPT_SUFFIX`` ("=?\\nA:"), where the model starts writing."""
    solution: str
    """The worked solution: a leading space, one line per step, then ``"#### <answer>"``; no trailing newline."""
    answer: str
    """The final value as decimal text, e.g. "43"."""
    num_steps: int
    """Number of operations, i.e. of solution lines before the answer line."""


def _apply(value: int, op: str, operand: int) -> int:
    return value + operand if op == "+" else value - operand


SOLUTION_STYLES = get_args(SolutionStyle)
"""How a worked solution is written: ``chain`` one short line per step (``55+1=56``); ``restate`` copies the
whole remaining expression each line with its first operation done (``=56-8-5``), as reasoning traces
restate what is left: length quadratic in the steps, and mostly text a drafter can copy."""


def _operations_text(operations: list[tuple[str, int]]) -> str:
    return "".join(f"{op}{operand}" for op, operand in operations)


def _solution_lines(operations: list[tuple[str, int]], values: list[int], style: str) -> list[str]:
    """The worked lines before the answer; ``values[i]`` is the value after the first i operations."""
    if style == "restate":  # the expression, then "=" + each value so far + the operations left
        return [("=" if i else "") + f"{value}{_operations_text(operations[i:])}" for i, value in enumerate(values)]
    return [f"{value}{op}{operand}={result}" for value, (op, operand), result in zip(values, operations, values[1:])]


def _format_problem(start: int, operations: list[tuple[str, int]], style: str = "chain") -> Problem:
    prompt = PROMPT_PREFIX + str(start) + _operations_text(operations) + PROMPT_SUFFIX
    values = [start]
    for op, operand in operations:
        values.append(_apply(values[-1], op, operand))
    lines = _solution_lines(operations, values, style)
    solution = " " + "\n".join(lines) + f"\n{ANSWER_MARKER} {values[-1]}"
    return Problem(prompt=prompt, solution=solution, answer=str(values[-1]), num_steps=len(operations))


def with_other_answer_format(solution: str) -> str:
    """``solution`` with its final ``#### N`` line written as ``The answer is N``.

    Demonstrations gathered from several sources state answers in several formats, while a verifier
    reads one; the warm-up corpus mixes both (``warmup.other_answer_format_share``), so the first
    thing RL has to teach is the format the reward reads, as it is for real reasoning models.
    """
    body, _, answer = solution.rpartition(f"\n{ANSWER_MARKER} ")
    if not body:
        raise ValueError(f"not a worked solution ending in '{ANSWER_MARKER} <answer>': {solution!r}")
    return f"{body}\n{OTHER_ANSWER_PREFIX}{answer}"


def with_checks(problem: Problem, num_checks: int) -> str:
    """``problem.solution`` with ``num_checks`` check passes before its answer line.

    A check restates the question (``55+1-8-5=?``) and works it again, line for line::

         55+1=56          <- the solution's own lines
        56-8=48
        55+1-8-5=?        <- one check: the question again, then the same lines
        55+1=56
        56-8=48
        #### 48

    Every token of a check is one the model has already written or read, so a drafter predicts it well,
    and the answer line is unchanged, so the reward is the same with or without checks.
    """
    if num_checks < 0:
        raise ValueError(f"num_checks must be >= 0, got {num_checks}")
    body, marker, answer = problem.solution.rpartition(f"\n{ANSWER_MARKER} ")
    question = problem.prompt.removeprefix(PROMPT_PREFIX).removesuffix(PROMPT_SUFFIX) + QUESTION_END
    check = f"\n{question}\n{body.lstrip(' ')}"
    return body + check * num_checks + marker + answer


def step_count_weights(max_steps: int, tail: float) -> list[float]:
    """Unnormalised probabilities of 1..max_steps steps: a truncated Zipf law, P(k) ~ k ** -tail."""
    return [k**-tail for k in range(1, max_steps + 1)]


def generate_problems(
    num: int, *, seed: int, max_steps: int = DEFAULT_MAX_STEPS, tail: float = DEFAULT_TAIL, style: str = "chain"
) -> list[Problem]:
    """``num`` problems, the same for the same arguments.

    The step count follows ``step_count_weights(max_steps, tail)``: a smaller ``tail`` gives more long
    problems (at the default 1.5 and 20 steps, ~46% take one step and ~10% take nine or more). Each
    operation is + or - with an operand in 1..MAX_OPERAND, flipped when it would leave 0..MAX_VALUE.
    """
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    if tail <= 0:
        raise ValueError(f"tail must be > 0 (a Zipf exponent), got {tail}")
    if style not in SOLUTION_STYLES:
        raise ValueError(f"style must be one of {', '.join(SOLUTION_STYLES)}, got '{style}'")
    rng = random.Random(seed)
    step_counts = range(1, max_steps + 1)
    weights = step_count_weights(max_steps, tail)
    problems = []
    for _ in range(num):
        num_steps = rng.choices(step_counts, weights=weights)[0]
        value = start = rng.randint(0, MAX_VALUE)
        operations = []
        for _ in range(num_steps):
            op, operand = rng.choice("+-"), rng.randint(1, MAX_OPERAND)
            if not 0 <= _apply(value, op, operand) <= MAX_VALUE:
                op = "-" if op == "+" else "+"  # operand <= 9 < range, so the flip always lands inside
            operations.append((op, operand))
            value = _apply(value, op, operand)
        problems.append(_format_problem(start, operations, style))
    return problems


def solve(prompt: str) -> str:
    """The correct answer to ``prompt``, computed from the prompt text alone; ValueError if malformed."""
    match = _PROMPT_RE.match(prompt)
    if match is None:
        raise ValueError(f"not a synthetic-task prompt: {prompt!r}")
    value = int(match.group(1))
    for op, operand in _OPERATION_RE.findall(match.group(2)):
        value = _apply(value, op, int(operand))
    return str(value)


def extract_answer(response: str) -> str | None:
    """The final answer the reward sees: ``rewards.extract_final_answer`` (one rule for both)."""
    from megatron_tlt.rl.rewards.functions import extract_final_answer

    return extract_final_answer(response)


def is_correct(prompt: str, response: str) -> bool:
    """Whether ``response`` (the model's text after ``prompt``) states the right answer, by exact match."""
    return extract_answer(response) == solve(prompt)


def task_corpus(num: int, seed: int, **problem_kwargs) -> list[str]:
    """Full worked texts (prompt + solution) of ``generate_problems(num, seed=seed, ...)``.

    For training the tokenizer; use a seed other than the RL prompts' one. Every other text states
    its answer in the other format (``with_other_answer_format``), so the vocabulary covers both.
    """
    problems = generate_problems(num, seed=seed, **problem_kwargs)
    return [p.prompt + (with_other_answer_format(p.solution) if i % 2 else p.solution) for i, p in enumerate(problems)]


def train_task_tokenizer(out_dir: str | Path, *, vocab_size: int = 320, num_texts: int = 2000, seed: int = 0) -> Path:
    """Train the tiny default's sentencepiece tokenizer on ``task_corpus``; return its ``tokenizer.model``.

    The digit-split vocabulary has under 300 pieces (256 of them byte fallbacks), so ``vocab_size``
    is an upper bound rather than a target.
    """
    # Imported here: only making a tokenizer needs sentencepiece.
    from megatron_tlt.formats.tokenizer import train_sentencepiece

    return train_sentencepiece(task_corpus(num_texts, seed), out_dir, vocab_size)


def solution_num_tokens(problem: Problem, tokenizer) -> int:
    """Tokens the policy writes for the solution: those of prompt + solution beyond the prompt's, no EOS."""
    return len(tokenizer.encode(problem.prompt + problem.solution)) - len(tokenizer.encode(problem.prompt))


def _summary(values: list[int], unit: str) -> dict[str, float]:
    ordered = sorted(values)
    p90 = ordered[math.ceil(0.9 * len(ordered)) - 1]  # nearest-rank percentile
    return {
        f"mean_{unit}": statistics.fmean(ordered),
        f"median_{unit}": statistics.median(ordered),
        f"p90_{unit}": p90,
        f"max_{unit}": ordered[-1],
    }


def length_stats(problems: list[Problem], tokenizer=None) -> dict[str, float]:
    """Mean, median, p90 and max of solution lengths in characters (``*_chars``) and steps (``*_steps``).

    With a ``tokenizer`` (anything with ``encode(text) -> list[int]``) also in tokens (``*_tokens``, see
    ``solution_num_tokens``) and the longest prompt + solution (``max_total_tokens``, no BOS/EOS).
    """
    if not problems:
        raise ValueError("length_stats needs at least one problem")
    stats: dict[str, float] = {"num_problems": len(problems)}
    stats |= _summary([len(p.solution) for p in problems], "chars")
    stats |= _summary([p.num_steps for p in problems], "steps")
    if tokenizer is not None:
        stats |= _summary([solution_num_tokens(p, tokenizer) for p in problems], "tokens")
        stats["max_total_tokens"] = max(len(tokenizer.encode(p.prompt + p.solution)) for p in problems)
    return stats
