"""What the spot trainer costs the RL critical path, speculation off, same seeds: paired runs in ABBA order.

    python bench/spot_overhead.py                    # the tiny default, 3 pairs of 12-step runs
    python bench/spot_overhead.py --pairs 4 --steps 16 -- optimizer.lr=1e-4

Each pair is two runs of the same seeds (so identical rollouts, rewards and updates): one with the spot
trainer on, one with it off, compared step by step. The pairs alternate which runs first (on-off, off-on, ...),
so a slow spell of this shared machine falls on both arms alike. (Until 2026-12-02 one run trained in the even
steps and the other in the odd ones, through a config key kept for this bench alone; the key is gone.)

The critical path is the step's wall time (``step_seconds``): rollout until the slowest rank is done and
every rank is released (the preemption delay), the drafter's replica averaging, reward, log-prob (with
feature capture when on), update and sync. Per-phase maxima over ranks are printed to show where a
difference lies (they overlap: a rank's release delay shows in its rollout and in the others' wait at the
averaging). Step 1 (engine warm-up, no features yet) is left out. Uses the cached warm-up of the tiny
default (made on first use).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

PHASE_KEYS = ("rollout_seconds", "reward_seconds", "logprob_seconds", "update_seconds", "sync_seconds")


def _run(steps: int, spot: bool, run_dir: Path, extra: list[str]) -> list[dict]:
    command = ["tlt", "train", f"trainer.steps={steps}", "trainer.eval_every=0", "data.held_out_prompts=0",
               "trainer.save_every=0", f"drafter.spot_training={str(spot).lower()}", "drafter.depth=0",
               f"trainer.run_dir={run_dir}", *extra]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads((run_dir / "summary.json").read_text())[1:]  # step 1: engine warm-up, no features yet


def _critical_path(records: list[dict], key: str = "step_seconds") -> float:
    return sum(r[key] for r in records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3, help="on/off run pairs")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args()
    all_on, all_off, ratios, same_rewards = [], [], [], True
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            order = (True, False) if pair % 2 == 0 else (False, True)
            runs = {spot: _run(args.steps, spot, Path(tmp) / f"pair{pair}-{'on' if spot else 'off'}", args.overrides)
                    for spot in order}
            on, off = runs[True], runs[False]
            same_rewards &= [r["reward_mean"] for r in on] == [r["reward_mean"] for r in off]
            all_on += on
            all_off += off
            ratios.append(_critical_path(on) / _critical_path(off))
            rows = sum(sum(r["drafter/tokens_trained"]) for r in on)
            print(f"pair {pair}: critical path with the spot trainer {_critical_path(on):.2f}s, without "
                  f"{_critical_path(off):.2f}s over {len(on)} steps each, ratio {ratios[-1]:.4f}; drafter rows "
                  f"trained {rows}", flush=True)
    for key in PHASE_KEYS:
        a, b = _critical_path(all_on, key), _critical_path(all_off, key)
        print(f"  {key:16s} with {a:7.3f}s  without {b:7.3f}s  ({100 * (a / b - 1):+.1f}%)")
    latency = [max(r["drafter/release_latency_seconds"]) for r in all_on]
    dropped = sum(sum(r["drafter/dropped_micro_steps"]) for r in all_on)
    steps = sum(sum(r["drafter/micro_steps"]) for r in all_on)
    print(f"  release latency of the last rank out, per step: median {1000 * statistics.median(latency):.1f} ms, "
          f"max {1000 * max(latency):.1f} ms; micro-steps {steps}, dropped by preemption {dropped}")
    total = _critical_path(all_on) / _critical_path(all_off)
    print(f"critical path, spot trainer on / off: {total:.4f} ({100 * (total - 1):+.2f}%); per pair "
          f"{', '.join(f'{r:.4f}' for r in ratios)}; identical rewards in every pair: {same_rewards}")


if __name__ == "__main__":
    main()
