"""What the spot trainer costs the RL critical path: the same run with it on and off, speculation off in
both, same seeds (so the rollouts, rewards and updates are identical), runs interleaved on/off/on/off.

    python bench/spot_overhead.py                    # the tiny default, 2 pairs of 12-step runs
    python bench/spot_overhead.py --pairs 3 --steps 20 -- optimizer.lr=1e-4

The critical path of a step is every phase in turn: rollout (until the slowest rank is done, which
includes any preemption delay), reward, log-prob, update and sync. Its sum over the measured steps is
compared between the two settings; the first step of every run (engine warm-up, no drafter
features yet) is left out. Uses the cached warm-up of the tiny default (made on first use).
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
               "trainer.save_every=0", f"drafter.spot_training={str(spot).lower()}", "drafter.speculative_tokens=0",
               f"trainer.run_dir={run_dir}", *extra]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads((run_dir / "summary.json").read_text())


def _critical_path(records: list[dict]) -> float:
    return sum(sum(r[k] for k in PHASE_KEYS) for r in records[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2, help="on/off run pairs, interleaved")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for both settings")
    args = parser.parse_args()
    seconds = {True: [], False: []}
    trained, same_rewards = [], True
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            runs = {}
            for spot in (True, False):
                runs[spot] = _run(args.steps, spot, Path(tmp) / f"pair{pair}-{'on' if spot else 'off'}", args.overrides)
                seconds[spot].append(_critical_path(runs[spot]))
            trained.append(sum(sum(r["drafter/tokens_trained"]) for r in runs[True]))
            same_rewards &= [r["reward_mean"] for r in runs[True]] == [r["reward_mean"] for r in runs[False]]
            print(f"pair {pair}: critical path on {seconds[True][-1]:.2f}s, off {seconds[False][-1]:.2f}s, "
                  f"ratio {seconds[True][-1] / seconds[False][-1]:.4f}; drafter rows trained {trained[-1]:.0f}",
                  flush=True)
        for key in PHASE_KEYS:  # where the difference lies (last pair)
            a, b = (sum(r[key] for r in runs[spot][1:]) for spot in (True, False))
            print(f"  {key:16s} on {a:7.3f}s  off {b:7.3f}s  ({100 * (a / b - 1):+.1f}%)")
    on, off = sum(seconds[True]), sum(seconds[False])
    ratios = [a / b for a, b in zip(seconds[True], seconds[False])]
    print(f"critical path, spot trainer on / off: {on / off:.4f} ({100 * (on / off - 1):+.2f}%), median of pairs "
          f"{statistics.median(ratios):.4f}, per pair {', '.join(f'{r:.4f}' for r in ratios)}; "
          f"identical rewards: {same_rewards}")


if __name__ == "__main__":
    main()
