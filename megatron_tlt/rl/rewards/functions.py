"""Verifiable rewards: pure functions ``(response_text, ground_truth) -> float`` and a registry of them.

``get_reward_fn(spec)`` resolves a config's reward: a registered name (``"exact_match"``,
``"math_verify"``) or the import path of the user's own function, ``"package.module:function"``.
A reward does no I/O and keeps no state, so it may run in any process or thread; the trainer decodes
responses without special tokens before calling it.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from collections.abc import Callable

RewardFn = Callable[[str, str], float]

# math-verify's own per-call limit; it applies only on the main thread (see math_verify_reward).
MATH_VERIFY_TIMEOUT_S = 5

_BOXED = "\\boxed"
_HASHES = "####"
_REGISTRY: dict[str, RewardFn] = {}


class RewardError(ValueError):
    """A reward that cannot be resolved or run: unknown name, bad import path, missing package."""


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make ``fn`` available to ``get_reward_fn(name)``."""

    def register(fn: RewardFn) -> RewardFn:
        assert name not in _REGISTRY, f"reward {name!r} registered twice"
        _REGISTRY[name] = fn
        return fn

    return register


def _last_boxed(text: str) -> tuple[int, str] | None:
    """(start, content) of the last ``\\boxed{...}`` whose braces close; None when there is none."""
    start = text.rfind(_BOXED)
    while start >= 0:
        open_at = start + len(_BOXED)
        while open_at < len(text) and text[open_at].isspace():
            open_at += 1
        if open_at < len(text) and text[open_at] == "{":
            depth = 0
            for end in range(open_at, len(text)):
                depth += {"{": 1, "}": -1}.get(text[end], 0)
                if depth == 0:
                    return start, text[open_at + 1 : end]
        start = text.rfind(_BOXED, 0, start)  # unclosed (a truncated response): try an earlier box
    return None


def extract_final_answer(text: str) -> str | None:
    """The final answer stated in ``text``, whitespace-normalised; None when ``text`` states none. The rule:

    1. Candidates are the content of the last ``\\boxed{...}`` whose braces balance (nested braces
       allowed; an unclosed box, as in a truncated response, is ignored), and the text after the last
       ``####`` up to the end of its line (leading whitespace and blank lines skipped first), so text the
       model goes on to write after the answer line does not count.
    2. If both exist, the one whose marker comes later in the text wins; if neither does, the answer is None.
    3. The answer is stripped and every run of whitespace becomes one space. Nothing else changes:
       case, punctuation, ``$`` and thousands separators are kept (use math_verify for lenient checks).
    """
    candidates = []
    boxed = _last_boxed(text)
    if boxed is not None:
        candidates.append(boxed)
    hashes_at = text.rfind(_HASHES)
    if hashes_at >= 0:
        rest = text[hashes_at + len(_HASHES) :].lstrip()
        candidates.append((hashes_at, rest.split("\n", 1)[0]))
    if not candidates:
        return None
    return " ".join(max(candidates)[1].split())


@register_reward("exact_match")
def exact_match_reward(response_text: str, ground_truth: str) -> float:
    """1.0 when the response's final answer (``extract_final_answer``) equals the ground truth, else 0.0.

    A response without a ``####`` or ``\\boxed{}`` answer, or with an empty one, scores 0.0. The ground
    truth is normalised the same way; when it has a marker itself (a full GSM8K solution "... #### 72")
    its final answer is used, otherwise all of it.
    """
    answer = extract_final_answer(response_text)
    if not answer:
        return 0.0
    expected = extract_final_answer(ground_truth)
    return 1.0 if answer == (" ".join(ground_truth.split()) if expected is None else expected) else 0.0


def _import_math_verify():
    try:
        import math_verify
    except ImportError:
        raise RewardError(
            "the math_verify reward needs the math-verify package: pip install math-verify "
            "(or use reward 'exact_match')"
        ) from None
    return math_verify


@register_reward("math_verify")
def math_verify_reward(response_text: str, ground_truth: str) -> float:
    """1.0 when math-verify finds the response's answer mathematically equal to the ground truth, else 0.0.

    A bare ground truth ("72", "\\frac{1}{2}") is parsed as if boxed, as VeRL does; one that already
    has ``\\boxed`` or ``$`` is parsed as written. math-verify times out with SIGALRM, which only the main
    thread may use; elsewhere it runs without a time limit (its documented advice for threads). Raises
    RewardError when math-verify is not installed.
    """
    math_verify = _import_math_verify()
    timeout_s = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold_text = ground_truth if (_BOXED in ground_truth or "$" in ground_truth) else f"{_BOXED}{{{ground_truth}}}"
    gold = math_verify.parse(gold_text, parsing_timeout=timeout_s)
    answer = math_verify.parse(response_text, parsing_timeout=timeout_s)
    if not gold or not answer:
        return 0.0
    return 1.0 if math_verify.verify(gold, answer, timeout_seconds=timeout_s) else 0.0


def _import_reward(spec: str) -> RewardFn:
    module_name, _, attr_path = (part.strip() for part in spec.partition(":"))
    if not module_name or not attr_path:
        raise RewardError(f"reward {spec!r}: an import path must look like 'package.module:function'")
    try:
        obj = importlib.import_module(module_name)
    # Importing runs the user's module: any exception it raises means this spec cannot be used.
    except Exception as err:
        raise RewardError(
            f"reward {spec!r}: cannot import module {module_name!r} ({type(err).__name__}: {err}); "
            "is it installed or on PYTHONPATH?"
        ) from err
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise RewardError(f"reward {spec!r}: module {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise RewardError(f"reward {spec!r}: {attr_path!r} is a {type(obj).__name__}, not a function")
    try:
        inspect.signature(obj).bind("response", "ground truth")
    except TypeError:
        raise RewardError(
            f"reward {spec!r}: {attr_path} must accept (response_text, ground_truth) and return a float"
        ) from None
    except ValueError:
        pass  # no introspectable signature (some builtins): trust it
    return obj


def get_reward_fn(spec: str) -> RewardFn:
    """The reward named by ``spec``: a registered name or ``"package.module:function"``.

    Resolved eagerly so a bad config fails at startup: an unknown name, an import path that does not
    import or names nothing callable, and ``"math_verify"`` without its package all raise RewardError.
    """
    spec = spec.strip()
    if ":" in spec:
        return _import_reward(spec)
    if spec not in _REGISTRY:
        raise RewardError(
            f"unknown reward {spec!r}: registered rewards are {', '.join(sorted(_REGISTRY))}; "
            "or give your own function as 'package.module:function'"
        )
    if spec == "math_verify":
        _import_math_verify()
    return _REGISTRY[spec]
