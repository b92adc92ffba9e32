"""Rewards that misbehave on request, for the reward-pool tests (imported by Ray's worker processes).

The response text says what to do; any other text is scored by exact match, as the default task's reward.
"""

import os
import time

from megatron_tlt.rl.rewards.functions import exact_match_reward

HANG_SECONDS = 600  # far past any time-out the tests set: only the pool's kill ends it


def misbehaving(response_text: str, ground_truth: str) -> float:
    if response_text == "hang":
        time.sleep(HANG_SECONDS)
    if response_text == "crash":
        os._exit(1)  # the worker process dies on the spot, as a segfault or the OOM killer would end it
    if response_text == "raise":
        raise ValueError("cannot parse this response")
    return exact_match_reward(response_text, ground_truth)
