"""Where speculation pays on this machine: a step's cost by live batch size, for each fixed depth.

    python bench/depth_by_batch.py                                   # a rank's rollout: 8 prompts x 8 samples
    python bench/depth_by_batch.py --prompts 1 --samples 1 --rounds 24  # one request alone: the long tail
    python bench/depth_by_batch.py --depths 0,1,2,3,4,5

A rollout starts crowded and ends with a few long requests. Verifying K drafts of every request costs more
as the batch grows, while a lone request's step costs little more at depth 4 than at depth 0, so the gain of
each depth depends on the phase. For each depth, one process, one core (as rank 0 of `tlt train` runs), an
engine at that fixed depth with the config's cold-start drafter (depth 0: a plain engine) samples the same
prompts at the RL temperature, engines alternating; it prints tokens per second and the speedup over depth 0,
then per batch-size bucket (``speculation.bucket_bounds``) the time spent and the mean step cost, and that cost
in plain steps of the same bucket. Samples differ between engines (each draws its own), so whole-rollout
speedups carry the noise of the longest sample; the per-bucket step costs do not.
"""

from __future__ import annotations

import argparse
import bisect
import tempfile
from pathlib import Path

CONFIG = "tiny"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", default="0,2,3,4", help="fixed depths to compare, 0 = a plain engine")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per rollout (default: 8, a rank's share)")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt (default: 8)")
    parser.add_argument("--rounds", type=int, default=2, help="rollouts per depth, each on the next prompts")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    if 0 not in depths or min(depths) < 0 or len(set(depths)) != len(depths):
        parser.error("--depths must be distinct depths >= 0, 0 among them (the baseline)")
    if min(args.prompts, args.samples, args.rounds) < 1:
        parser.error("--prompts, --samples and --rounds must be >= 1")

    from megatron_tlt.launcher import run_like_rank_zero_of

    run_like_rank_zero_of(2)  # before torch starts its threads: the core and threads of a tlt train rank
    from megatron_tlt.commands.start import cold_start_drafter
    from megatron_tlt.config import load_config
    from megatron_tlt.drafter import store
    from megatron_tlt.parallel import ParallelLayout
    from megatron_tlt.rl.rank_session import RankSession
    from megatron_tlt.rl.weight_sync import iter_hf_tensors
    from megatron_tlt.spec.engine import RolloutEngine, SpeculativeSettings

    config = load_config(CONFIG, args.overrides)
    drafter_dir = cold_start_drafter(CONFIG, args.overrides)  # made and cached on first use
    bounds = config.speculation.bucket_bounds
    labels = [f"<={b}" for b in bounds] + [f">{bounds[-1]}"]
    with ParallelLayout(seed=0), tempfile.TemporaryDirectory() as workdir:
        session = RankSession(config, show_progress=True)
        drafter = store.read_drafter_tensors(drafter_dir, session.arch)
        examples = session.task.held_out or session.task.dataset.examples
        if len(examples) < 1 + args.rounds * args.prompts:
            parser.error(f"{1 + args.rounds * args.prompts} prompts needed, the task has {len(examples)}")
        prompts = [e.prompt_ids for e in examples]
        sampling = session.sampling(n=args.samples, temperature=config.rollout.temperature, seed=None)
        engines = {}
        for depth in depths:
            speculative = None if depth == 0 else SpeculativeSettings(
                num_speculative_tokens=depth, adaptive=None, seed=0, draft_sampling=config.speculation.draft_sampling)
            engine = RolloutEngine(session.arch, session.engine_config, workdir=Path(workdir) / f"depth{depth}", rank=0,
                                   speculative=speculative, drafter=drafter if depth else None)
            engine.load_weights(iter_hf_tensors(session.model, session.arch, padded_vocab_size=session.padded_vocab))
            if depth:
                engine.load_drafter(drafter)  # the reload replaced the drafter's shared heads with dummies
            engine.generate(prompts[:1], sampling)  # first-call costs stay out of the times
            engines[depth] = engine
        tokens = {d: 0 for d in depths}
        seconds = {d: 0.0 for d in depths}
        by_bucket = {d: [[0, 0.0] for _ in labels] for d in depths}  # steps, seconds
        for round_index in range(args.rounds):
            batch = prompts[1 + round_index * args.prompts: 1 + (round_index + 1) * args.prompts]
            for depth in (depths if round_index % 2 == 0 else depths[::-1]):  # ABBA: drift weighs on all alike
                result = engines[depth].generate(batch, sampling)
                tokens[depth] += result.num_generated_tokens
                seconds[depth] += result.seconds
                for live, step_seconds in zip(result.step_batch_sizes, result.step_seconds):
                    cell = by_bucket[depth][bisect.bisect_left(bounds, live)]
                    cell[0] += 1
                    cell[1] += step_seconds
        print(f"{args.prompts} prompts x {args.samples} samples at temperature {config.rollout.temperature}, "
              f"{args.rounds} rounds per depth")
        plain_rate = tokens[0] / seconds[0]
        plain_step = [s / n if n else None for n, s in by_bucket[0]]
        for depth in depths:
            rate = tokens[depth] / seconds[depth]
            print(f"depth {depth}: {rate:6.0f} tok/s, speedup {rate / plain_rate:.2f}x over depth 0, "
                  f"{seconds[depth]:.2f} s in all")
            for label, (steps, spent), plain in zip(labels, by_bucket[depth], plain_step):
                if steps:
                    cost = f", {spent / steps / plain:.2f} plain steps" if plain and depth else ""
                    print(f"    live {label:>5s}: {steps:5d} steps, {spent:6.2f} s, "
                          f"{1000 * spent / steps:6.2f} ms/step{cost}")
        for engine in engines.values():
            engine.close()
        session.close()


if __name__ == "__main__":
    main()
