"""The benchmark's slow reward: exact match after a sleep (``TLT_BENCH_REWARD_SLEEP_MS``, default 20 ms) per
response, standing in for a verifier or judge whose cost is mostly waiting. Loaded by import path
(``data.reward=sleepy_reward:exact_match_after_sleep``) with bench/ on PYTHONPATH."""

import os
import time

from megatron_tlt.rl.rewards.functions import exact_match_reward

SLEEP_S = float(os.environ.get("TLT_BENCH_REWARD_SLEEP_MS", "20")) / 1000.0


def exact_match_after_sleep(response_text: str, ground_truth: str) -> float:
    time.sleep(SLEEP_S)
    return exact_match_reward(response_text, ground_truth)
