"""A user reward loaded by import path in the trainer tests: shorter responses score higher.

Unlike exact match on a barely warmed-up policy, it gives every group unequal rewards, so every
step really moves the policy: a resume that lost optimizer or RNG state would show.
"""


def shorter_is_better(response_text: str, ground_truth: str) -> float:
    return -len(response_text) / 100.0
