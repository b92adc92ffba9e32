"""A user reward for the trainer test of the equal-reward filter: every other group of 4 samples scored in
a process gets equal rewards, the others distinct ones of a tiny scale, and every reward is logged.

Groups are scored prompt by prompt, their samples one after another (``ResponseScorer.score``, rl/scoring.py), so the k-th
call of a process belongs to its group k // 4. Each process appends its rewards to its own file in
``$TLT_TEST_REWARD_LOG``. A test helper only: a real reward keeps no state and does no I/O.
"""

import itertools
import os
from pathlib import Path

SAMPLES_PER_PROMPT = 4
_calls = itertools.count()


def every_other_group_equal(response_text: str, ground_truth: str) -> float:
    call = next(_calls)
    if (call // SAMPLES_PER_PROMPT) % 2 == 0:
        reward = 0.0  # one reward for the whole group
    else:  # shorter is better, about 1e-3 for 100 characters; the call number keeps the 4 apart
        reward = -len(response_text) / 1e5 + call / 1e6
    with open(Path(os.environ["TLT_TEST_REWARD_LOG"]) / f"rewards-{os.getpid()}.txt", "a") as log:
        log.write(f"{reward!r}\n")
    return reward
