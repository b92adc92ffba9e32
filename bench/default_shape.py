"""Is a `tlt train` job shaped like reasoning RL? The figures TLT's payoff depends on, measured.

    python bench/default_shape.py                        # the tiny default, 6 steps, TLT off
    python bench/default_shape.py --steps 10 -- rollout.max_response_tokens=512

Reasoning RL, which TLT is for, spends most of a step in the rollout, its response lengths have a long
tail (a few run 10x the median), and its drafter is one layer beside 28-80. This prints, for the
configured job (issue 18's targets in brackets):
  * the drafter's cost per token beside the policy's forward, from both models' matmul FLOPs: the
    drafter's one layer and fc, and the LM head it runs per draft token [<= 1/8];
  * response lengths per step: median, max and max / median [>= 8], and the truncated share [rare];
  * each phase's share of the step with TLT off over steps 2..N (step 1 holds first-call costs)
    [rollout >= 70%].
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

CONFIG = "tiny"  # tlt train's default config, which the job below runs
PHASES = ("rollout_seconds", "reward_seconds", "logprob_seconds", "update_seconds", "sync_seconds")


def drafter_cost_share(overrides: list[str]) -> tuple[float, int, int]:
    """(drafter FLOPs per draft token / policy FLOPs per token, policy layers, drafter parameters)."""
    from megatron_tlt.config import load_config
    from megatron_tlt.plan.model import drafter_parameters
    from megatron_tlt.rl.task_source import task_source
    from megatron_tlt.spec.ceiling import drafter_cost_share as cost_share

    arch = task_source(load_config(CONFIG, overrides)).architecture()  # the config `tlt train` runs below
    return cost_share(arch), arch.num_layers, drafter_parameters(arch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the job")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (step 1 is left out of the phase shares)")
    share, layers, drafter_params = drafter_cost_share(args.overrides)
    print(f"drafter / policy forward FLOPs per token: {share:.3f} (1/{1 / share:.1f}; policy {layers} layers, "
          f"drafter {drafter_params / 1e6:.2f}M parameters)  [target <= 1/8]")
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        subprocess.run(["tlt", "train", "--config", CONFIG, f"trainer.run_dir={run_dir}", f"trainer.steps={args.steps}",
                        "trainer.eval_every=0", "trainer.save_every=0", "drafter.depth=0",
                        "drafter.spot_training=false", *args.overrides],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        records = json.loads((run_dir / "summary.json").read_text())
    print("step  length median  max  max/median  truncated")
    for r in records:
        print(f"{r['step']:4d}  {r['response_length_median']:13.1f}  {r['response_length_max']:3d}  "
              f"{r['response_length_max'] / r['response_length_median']:10.1f}  {r['truncated_share']:9.3f}")
    ratios = [r["response_length_max"] / r["response_length_median"] for r in records]
    print(f"max / median per step: median {statistics.median(ratios):.1f}, min {min(ratios):.1f}  [target >= 8]")
    timed = records[1:]
    step = sum(r["step_seconds"] for r in timed)
    shares = ", ".join(f"{key.removesuffix('_seconds')} {sum(r[key] for r in timed) / step:.0%}" for key in PHASES)
    print(f"share of the step (steps 2-{args.steps}, TLT off): {shares}  [target: rollout >= 70%]")


if __name__ == "__main__":
    main()
