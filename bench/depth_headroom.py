"""What could any adaptive speculation depth gain over the best fixed depth on the default's rollouts? Ceilings.

    python bench/depth_headroom.py                          # depths 0,4,8,12,16; 4 rounds of 8 prompts x 8 samples
    python bench/depth_headroom.py --depths 0,2,4,6,8 --rounds 6
    python bench/depth_headroom.py -- rollout.temperature=0.7   # config overrides after --
    python bench/depth_headroom.py --save-trace trace.json      # keep the trace and the measured step costs
    python bench/depth_headroom.py --trace trace.json --step-costs costs.json   # price it with another machine's
    python bench/depth_headroom.py --trace trace.json --bucket-bounds 1,4,16        # or with other buckets

On a pretrained model (``model.hf_dir`` picks ``launch/configs/hf.yaml``, as ``tlt train`` does; the real-model
bench makes SmolLM2-135M-Instruct's directory and word problems: ``bench/real_model.py``):

    python bench/depth_headroom.py --depths 0,1,2,4 --prompts 4 --rounds 2 --save-trace trace.json -- \
        model.hf_dir=DIR data.path=P.jsonl data.reward=exact_match rollout.max_response_tokens=384

(Without ``data.held_out_path`` the rollouts take the prompts the cold start held out of the prompt file, the file's
last ``drafter.cold_start.eval_prompts``, wrapping round where the rounds need more.)

One process on the core and thread of one `tlt train` rank, as `tlt bench rollout` runs. One speculating engine
with the config's cold-start drafter samples new held-out prompts each round at the RL temperature, pinned at each
depth of --depths in turn (a first, untimed round warms it up). Every step's time gives each batch-size bucket a
step-cost line in depth; the deepest run records how many drafts each request accepted at each step (the trace).
From them (``bench/depth_ceilings.py``) it prints the time the traced work would take
  * at each fixed depth 0..deepest,
  * at the best depth of each batch-size bucket: the ceiling of BEG-MAB and of vLLM's per-batch-size table,
  * at the best depth per bucket and per the requests' last outcome: the ceiling of a policy that reads
    acceptance streaks (the goodput model's per-request rates, draft-length heuristics),
  * clairvoyant, each step at its own best depth,
each as a speedup over the best fixed depth. The ceilings choose knowing the trace and pay nothing to explore:
where they lie within a few percent of the best fixed depth, no adaptive policy can beat it by more.

``--step-costs`` prices the same traced work with step costs measured elsewhere (``bench/gpu_step_cost.py`` on a
GPU, rows up to the trace's widest batch): what the ceilings would be where a step costs what it costs there,
for this drafter's acceptance.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

CONFIG = None  # --config, else tiny (hf where the overrides set model.hf_dir)


def _measure(args: argparse.Namespace) -> dict:
    """The trace record: the deepest depth, the buckets, the deepest runs' acceptance lengths, (batch, depth,
    seconds) of every timed step, and the deepest runs' steps ((request, accepted) of each request)."""
    from megatron_tlt.commands.start import cold_start_drafter
    from megatron_tlt.config import load_config
    from megatron_tlt.drafter import store
    from megatron_tlt.drafter.tlt_drafter import FrozenDrafter
    from megatron_tlt.parallel import ParallelLayout
    from megatron_tlt.rl.rank_session import RankSession
    from megatron_tlt.spec.engine import SpeculativeSettings
    from rollout_bench import prompt_sets  # a sibling: bench/ is the script's folder

    config = load_config(CONFIG, args.overrides)
    config.data.held_out_prompts = max(config.data.held_out_prompts, args.prompts * (args.rounds + 1))
    drafter_dir = cold_start_drafter(CONFIG, args.overrides)
    deepest = max(args.depths)
    # an engine whose depth can be pinned per rollout (its adaptive scheduler's pin_depth: the engine has no method
    # for a bench's pins), speculating up to the deepest depth
    adaptive = dataclasses.replace(config.speculation, adaptive=True, depths=sorted({0, *args.depths}))
    speculation = SpeculativeSettings(num_speculative_tokens=deepest, adaptive=adaptive, seed=config.trainer.seed,
                                      draft_sampling=config.speculation.draft_sampling)
    timed, traces, acceptance = [], [], []
    with ParallelLayout(seed=config.trainer.seed), tempfile.TemporaryDirectory(prefix="tlt-headroom-") as workdir:
        session = RankSession(config, policy_dir=None, show_progress=False)
        drafter = FrozenDrafter(store.read_drafter_tensors(drafter_dir, session.task.arch))
        engine = session.open_engine(Path(workdir) / "spec", speculative=speculation, drafter=drafter)
        try:
            session.sync(engine, drafter)
            rollouts = prompt_sets([e.prompt_ids for e in _prompt_pool(session.task, config)], args.prompts,
                                   rotate=True)
            sampling = session.sampling(n=config.rollout.samples_per_prompt, temperature=config.rollout.temperature,
                                        seed=None)
            for round_index in range(-1, args.rounds):  # round -1: untimed warm-up
                prompts = next(rollouts)
                for depth in args.depths:
                    engine.adaptive_scheduler().pin_depth(depth)
                    result = engine.generate(prompts, sampling)
                    if round_index < 0:
                        continue
                    timed += [(b, depth, s) for b, s in zip(result.step_batch_sizes, result.step_seconds)]
                    if depth == deepest:
                        traces.append(result.step_drafts)
                        acceptance.append(result.spec.mean_acceptance_length)
                print(f"round {round_index + 1} of {args.rounds} done", flush=True)
        finally:
            session.close()
    return {"depth": deepest, "bucket_bounds": list(adaptive.bucket_bounds), "acceptance_lengths": acceptance,
            "timed_steps": timed, "rollouts": traces}


def _prompt_pool(task, config) -> list:
    """The held-out prompts; without a held-out file (``data.path`` alone), those the cold start held out of the
    prompt file for its own figures (its tail), which it did not train on. Rollouts wrap round a short pool."""
    if task.held_out:
        return task.held_out
    from megatron_tlt.commands.warmup_drafter import split_cold_start_prompts

    _, held_out = split_cold_start_prompts(task, config.drafter.cold_start)
    print(f"no held-out file (data.held_out_path): the {len(held_out)} prompts the cold start held out of the "
          "prompt file", flush=True)
    return held_out


def _step_costs_from(path: str, widest_batch: int) -> list:
    """(batch, depth, seconds) rows of ``bench/gpu_step_cost.py --out``, up to the trace's widest batch."""
    record = json.loads(Path(path).read_text())
    print(f"step costs from {path}: {record['device']}, shapes {record['shape']}, context {record['context']}")
    return [row for row in record["rows"] if row[0] <= widest_batch]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None,
                        help="config name under launch/configs or a YAML path (default: tiny; hf with model.hf_dir)")
    parser.add_argument("--depths", default="0,4,8,12,16",
                        help="pinned depths that measure the step cost; the deepest also traces acceptance")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per rollout (default: 8, a rank's share)")
    parser.add_argument("--rounds", type=int, default=4, help="timed rollouts per depth (default: 4)")
    parser.add_argument("--save-trace", metavar="PATH", help="write the trace and the measured step costs as JSON")
    parser.add_argument("--trace", metavar="PATH", help="read a saved trace instead of running rollouts")
    parser.add_argument("--step-costs", metavar="PATH",
                        help="price the trace with these step costs (bench/gpu_step_cost.py --out) instead")
    parser.add_argument("--bucket-bounds", metavar="B1,B2,...",
                        help="price the work with these batch-size buckets instead of the config's "
                             "(speculation.bucket_bounds): a saved trace priced with other bounds")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    args = parser.parse_args()
    args.depths = sorted({int(d) for d in args.depths.split(",")})
    if len(args.depths) < 2 or args.depths[0] < 0 or args.rounds < 1 or args.prompts < 1:
        parser.error("--depths needs two or more depths >= 0; --rounds and --prompts must be >= 1")
    if args.bucket_bounds:  # checked before any rollout runs, not after the measurement
        args.bucket_bounds = sorted({int(b) for b in args.bucket_bounds.split(",")})
        if args.bucket_bounds[0] < 1:
            parser.error(f"--bucket-bounds must be batch sizes >= 1, got {args.bucket_bounds}")
    global CONFIG
    from megatron_tlt.config.loading import config_name_for

    CONFIG, chosen = config_name_for(args.config, args.overrides)
    if chosen and not args.trace:
        print(chosen, flush=True)

    from megatron_tlt.launcher import run_like_rank_zero_of

    run_like_rank_zero_of(2)  # before torch starts its threads: the core and threads of a tlt train rank
    from megatron_tlt.config import SpeculationConfig
    from megatron_tlt.spec.bandit import BucketedEpsilonGreedy
    from depth_ceilings import StepCost, headroom  # a sibling: bench/ is the script's folder

    if args.trace:
        record = json.loads(Path(args.trace).read_text())
    else:
        record = _measure(args)
        if args.save_trace:
            Path(args.save_trace).write_text(json.dumps(record))
    deepest, bounds = record["depth"], record["bucket_bounds"]
    if args.bucket_bounds:
        bounds = args.bucket_bounds
    widest = max(len(step) for steps in record["rollouts"] for step in steps)
    rows = _step_costs_from(args.step_costs, widest) if args.step_costs else record["timed_steps"]
    cost = StepCost.fit(rows, bounds)
    ceilings = headroom(record["rollouts"], deepest, cost)
    if cost.bucket_bounds:
        label = BucketedEpsilonGreedy(SpeculationConfig(bucket_bounds=list(cost.bucket_bounds)),
                                      max_depth=deepest).bucket_label
    else:  # every bound at or above the widest batch: one bucket
        label = lambda _bucket: "every batch"  # noqa: E731
    best = ceilings.best_fixed_depth
    print(f"\n{len(record['rollouts'])} traced rollouts ({ceilings.steps} steps); acceptance length at depth "
          f"{deepest}: {statistics.fmean(record['acceptance_lengths']):.2f}")
    print("step cost per batch-size bucket, in steps at depth 0 there: "
          + ", ".join(f"{label(b)}: 1 + {slope / intercept:.3f} K"
                      for b, (intercept, slope) in enumerate(cost.lines)))
    print("time of the traced work at each fixed depth, over the best (depth "
          f"{best}): " + ", ".join(f"{k}: {t / ceilings.fixed[best]:.3f}" for k, t in ceilings.fixed.items()))
    print("best depth per bucket, knowing the trace: " + ", ".join(
        f"{label(b)}: {k}" for b, k in ceilings.per_bucket_depths.items()))
    for name, seconds in (("best depth per batch-size bucket (BEG-MAB's, the table's ceiling)", ceilings.per_bucket),
                          ("best depth per bucket and last outcome", ceilings.per_bucket_and_last_outcome),
                          ("clairvoyant, each step at its own best depth", ceilings.clairvoyant)):
        print(f"  {name}: {ceilings.gain(seconds):.3f}x the best fixed depth")


if __name__ == "__main__":
    main()
