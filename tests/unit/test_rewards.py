"""Verifiable rewards: final-answer extraction, exact match, math-verify, and resolving a reward by name or path."""

import importlib.util
import sys
import textwrap

import pytest

from megatron_tlt.rl.rewards.functions import (
    RewardError,
    exact_match_reward,
    extract_final_answer,
    get_reward_fn,
    math_verify_reward,
)

HAS_MATH_VERIFY = importlib.util.find_spec("math_verify") is not None


@pytest.mark.parametrize(("text", "answer"), [
    ("Half of 10 is 5, plus 3 is 8.\n#### 8", "8"),
    ("#### 7\n\nQuestion: what is 2 + 2?", "7"),  # only the line after the marker
    ("#### 1\nwait, recheck\n####   12  ", "12"),  # the last marker wins
    ("####\n\n  42 apples ", "42 apples"),  # blank lines after the marker are skipped
    ("So x = \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),  # nested braces
    ("\\boxed{3} but actually \\boxed {  4\n  5 }", "4 5"),  # last box, whitespace collapsed
    ("\\boxed{3} then \\boxed{4", "3"),  # an unclosed (truncated) box is ignored
    ("#### 5, i.e. \\boxed{6}", "6"),  # the later marker wins
    ("\\boxed{6} so #### 5", "5"),
    ("#### 5\n\\boxed{", "5"),  # a later but unclosed box does not hide the hash answer
])
def test_final_answer_is_the_last_box_or_hash_answer_normalised(text, answer):
    assert extract_final_answer(text) == answer


def test_text_without_a_marker_states_no_answer():
    assert extract_final_answer("the answer is 9") is None
    assert extract_final_answer("\\boxed{9") is None


def test_exact_match_compares_final_answers_exactly():
    assert exact_match_reward("2 + 2 = 4\n#### 4", "4") == 1.0
    assert exact_match_reward("The answer is \\boxed{ 4 }.", "4") == 1.0
    assert exact_match_reward("#### 1  000", " 1 000\n") == 1.0
    assert exact_match_reward("4", "4") == 0.0  # no marker, no answer
    assert exact_match_reward("#### 4.", "4") == 0.0  # punctuation is not forgiven
    assert exact_match_reward("#### 1,000", "1000") == 0.0
    assert exact_match_reward("#### 5", "4") == 0.0
    assert exact_match_reward("Natalia sold 24 clips... #### 72", "She sold 48 + 24 = 72.\n#### 72") == 1.0
    assert exact_match_reward("####", "") == 0.0  # an empty answer never matches
    assert isinstance(exact_match_reward("#### 4", "4"), float)


def test_registered_names_resolve_to_their_functions():
    assert get_reward_fn("exact_match") is exact_match_reward
    assert get_reward_fn(" exact_match ") is exact_match_reward


def test_unknown_reward_name_lists_the_registered_ones():
    with pytest.raises(RewardError, match="unknown reward 'exakt_match': registered rewards are exact_match, "
                                          "math_verify"):
        get_reward_fn("exakt_match")


def test_math_verify_without_its_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
    with pytest.raises(RewardError, match="pip install math-verify"):
        get_reward_fn("math_verify")
    with pytest.raises(RewardError, match="pip install math-verify"):
        math_verify_reward("\\boxed{1}", "1")


@pytest.mark.skipif(not HAS_MATH_VERIFY, reason="math-verify is not installed (pip install math-verify)")
def test_math_verify_accepts_equal_values_in_other_forms():
    assert get_reward_fn("math_verify") is math_verify_reward
    assert math_verify_reward("So the answer is $\\boxed{\\frac{1}{2}}$.", "0.5") == 1.0
    assert math_verify_reward("The final answer is $\\boxed{72}$", "72") == 1.0
    assert math_verify_reward("The final answer is $\\boxed{73}$", "72") == 0.0


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's reward module importable from tmp_path, removed from sys.modules afterwards."""
    name = "my_rewards_for_test"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        def contains_answer(response_text, ground_truth):
            return 1.0 if ground_truth in response_text else 0.0

        class Scorers:
            @staticmethod
            def length(response_text, ground_truth):
                return float(len(response_text))

        def takes_one(response_text):
            return 0.0

        NOT_A_FUNCTION = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_user_reward_is_resolved_by_import_path(user_module):
    reward = get_reward_fn(f"{user_module}:contains_answer")
    assert reward("it is 42", "42") == 1.0 and reward("it is 41", "42") == 0.0
    assert get_reward_fn(f"{user_module}:Scorers.length")("abc", "") == 3.0


@pytest.mark.parametrize(("attr", "message"), [
    ("missing", "has no attribute 'missing'"),
    ("NOT_A_FUNCTION", "'NOT_A_FUNCTION' is a int, not a function"),
    ("takes_one", "must accept \\(response_text, ground_truth\\)"),
])
def test_an_import_path_to_something_unusable_names_the_spec(user_module, attr, message):
    spec = f"{user_module}:{attr}"
    with pytest.raises(RewardError, match=message) as info:
        get_reward_fn(spec)
    assert repr(spec) in str(info.value)


def test_an_import_path_that_does_not_import_names_the_spec_and_the_cause(tmp_path, monkeypatch):
    with pytest.raises(RewardError, match="reward 'no_such_pkg.rewards:fn': cannot import module 'no_such_pkg"
                                          ".rewards' \\(ModuleNotFoundError"):
        get_reward_fn("no_such_pkg.rewards:fn")
    (tmp_path / "broken_rewards_for_test.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match="RuntimeError: boom at import"):
        get_reward_fn("broken_rewards_for_test:fn")
    with pytest.raises(RewardError, match="must look like 'package.module:function'"):
        get_reward_fn("my_module:")
