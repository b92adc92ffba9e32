"""Rewards inline vs on the Ray pool, side by side: a reward that sleeps 20 ms per response on the tiny default.

    python bench/reward_pool.py                          # 10 steps each, 4 workers per rank
    python bench/reward_pool.py --steps 20 --workers 8 --sleep-ms 50 -- rollout.samples_per_prompt=16

Both runs use the same seeds and steps, so their rollouts and rewards must be identical (checked); only where
scoring happens differs. Inline, each rank scores its 64 responses (16 prompts x 8 samples over 2 ranks) one
after another once the rollout is done; with ``data.reward_workers=N`` each rank's pool scores them while the
rollout's tail still generates. Prints, over steps 2..N (step 1 holds the engines' first-call costs), the median
step time and phase times, the reward phase's share of all step time, and the share of responses the pool had
scored before the reward phase began.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REWARD = "sleepy_reward:exact_match_after_sleep"


def _run(run_dir: Path, overrides: list[str], sleep_ms: float) -> list[dict]:
    env = dict(os.environ, TLT_BENCH_REWARD_SLEEP_MS=str(sleep_ms),
               PYTHONPATH=os.pathsep.join(filter(None, [str(BENCH_DIR), os.environ.get("PYTHONPATH")])))
    result = subprocess.run(["tlt", "train", f"trainer.run_dir={run_dir}", *overrides], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        raise SystemExit(f"tlt train {' '.join(overrides)} failed:\n{result.stderr[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def _mean(records: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in records)


def _median(records: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--workers", type=int, default=4, help="reward workers per rank")
    parser.add_argument("--sleep-ms", type=float, default=20.0, help="the reward's sleep per response")
    parser.add_argument("--pool-first", action="store_true", help="run the pool before inline (order effects)")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for both runs")
    args = parser.parse_args()
    common = [f"trainer.steps={args.steps}", "trainer.eval_every=0", "trainer.save_every=0", f"data.reward={REWARD}",
              *args.overrides]
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"inline": common, "pool": common + [f"data.reward_workers={args.workers}"]}
        order = ("pool", "inline") if args.pool_first else ("inline", "pool")
        records = {name: _run(Path(tmp) / name, runs[name], args.sleep_ms) for name in order}
    inline, pooled = records["inline"], records["pool"]
    same = [a["reward_mean"] for a in inline] == [b["reward_mean"] for b in pooled]
    inline, pooled = inline[1:], pooled[1:]
    print(f"reward sleeping {args.sleep_ms:g} ms per response, {pooled[0]['num_samples']} responses a step, "
          f"steps 2-{args.steps} (medians over steps: a shared machine's load spikes hit single steps); "
          f"pool: {args.workers} workers per rank")
    print(f"  {'':28s} {'inline':>9s} {'pool':>9s}   inline / pool")
    for key, name in (("step_seconds", "step time (s)"), ("rollout_seconds", "rollout phase (s)"),
                      ("reward_seconds", "reward phase (s)"), ("logprob_seconds", "log-prob phase (s)"),
                      ("update_seconds", "update phase (s)"), ("sync_seconds", "sync phase (s)")):
        a, b = _median(inline, key), _median(pooled, key)
        print(f"  {name:28s} {a:9.3f} {b:9.3f}   {a / b:6.2f}x")
    share_inline = sum(r["reward_seconds"] for r in inline) / sum(r["step_seconds"] for r in inline)
    share_pool = sum(r["reward_seconds"] for r in pooled) / sum(r["step_seconds"] for r in pooled)
    print(f"  {'reward phase / step':28s} {share_inline:9.1%} {share_pool:9.1%}")
    print(f"  pool: responses scored before the reward phase began {_mean(pooled, 'reward/scored_in_rollout_share'):.1%}; "
          f"time-outs {sum(r['reward/timeouts'] for r in pooled)}, worker crashes "
          f"{sum(r['reward/worker_crashes'] for r in pooled)}, errors {sum(r['reward/errors'] for r in pooled)}")
    print(f"  rewards identical step for step: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
