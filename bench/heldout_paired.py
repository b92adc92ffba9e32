"""Does RL improve held-out accuracy on the default? Paired by problem, with its standard error.

    tlt train trainer.run_dir=runs/main
    python bench/heldout_paired.py --run runs/main            # 8 samples per problem
    python bench/heldout_paired.py --run RUN data.held_out_path=held_out.jsonl   # a run on a prompt file

The run's config.yaml says what to answer; key=value overrides after it change it for this measure (a run on a
prompt file made without ``data.held_out_path`` names its held-out file so).

One engine answers the run's held-out problems twice: with the run's initial policy, then with its latest
checkpoint. Each pass answers greedily and with --samples samples per problem at the rollout temperature, with
the same per-request seeds in both. A problem's sampled score is the mean over its samples. The difference
(after - before) is averaged over the problems. Its standard error, the SD of the per-problem differences over
sqrt(n), says how far the gain is from noise: the same problems on both sides take their difficulty out of it.
Also printed: the share of answers written the other way ("The answer is N"), which the exact-match reward
does not read.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

EVAL_SEED = 20261125  # any fixed seed: both policies sample with it


@dataclass
class PolicyAnswers:
    greedy: list[float]
    """Per problem: 1.0 when the greedy answer is right."""
    sampled: list[float]
    """Per problem: the share of its samples that are right."""
    other_format: float
    """Share of all sampled answers that state the answer as ``The answer is N``."""


def _answers(session, engine, examples, samples: int, temperature: float) -> PolicyAnswers:
    from megatron_tlt.rl.rewards.functions import get_reward_fn
    from megatron_tlt.rl.tiny import synthetic_task

    reward = get_reward_fn(session.config.data.reward)
    prompts = [e.prompt_ids for e in examples]

    def texts(result):
        return [[session.tokenizer.decode(r, skip_special_tokens=True) for r in responses]
                for responses in result.token_ids]

    greedy = texts(engine.generate(prompts, session.sampling(n=1, temperature=0.0, seed=None)))
    sampled = texts(engine.generate(prompts, session.sampling(n=samples, temperature=temperature, seed=EVAL_SEED)))
    other = [synthetic_task.OTHER_ANSWER_PREFIX in text for answers in sampled for text in answers]
    return PolicyAnswers(
        greedy=[float(reward(answers[0], e.ground_truth) > 0) for e, answers in zip(examples, greedy)],
        sampled=[statistics.fmean(float(reward(t, e.ground_truth) > 0) for t in answers)
                 for e, answers in zip(examples, sampled)],
        other_format=sum(other) / len(other))


def paired(before: list[float], after: list[float]) -> tuple[float, float]:
    """Mean of the per-problem differences (after - before) and its standard error."""
    differences = [a - b for a, b in zip(after, before, strict=True)]
    return statistics.fmean(differences), statistics.stdev(differences) / len(differences) ** 0.5


def evaluate(run: Path, samples: int, overrides: list[str] = ()) -> tuple[PolicyAnswers, PolicyAnswers, float]:
    """(the initial policy's answers, the latest checkpoint's, the temperature sampled at)."""
    from megatron_tlt.config import load_config
    from megatron_tlt.parallel import ParallelLayout
    from megatron_tlt.rl.rank_session import RankSession
    from megatron_tlt.rl.run.checkpoint_paths import resolve_policy_dir

    config = load_config(str(run / "config.yaml"), list(overrides))
    final_policy = resolve_policy_dir(run)  # before the engine starts: a wrong --run fails fast
    with ParallelLayout(seed=config.trainer.seed), tempfile.TemporaryDirectory(prefix="tlt-heldout-") as workdir:
        initial = RankSession(config)
        if not initial.task.held_out:
            raise SystemExit(f"{run}: its task has no held-out problems (a prompt file without data.held_out_path): "
                             "nothing to compare on; name one after --run: data.held_out_path=FILE")
        engine = initial.open_engine(Path(workdir) / "engine")
        try:
            initial.sync(engine)
            temperature = config.rollout.temperature
            before = _answers(initial, engine, initial.task.held_out, samples, temperature)
            trained = RankSession(config, policy_dir=final_policy)
            trained.sync(engine)
            after = _answers(trained, engine, initial.task.held_out, samples, temperature)
        finally:
            initial.close()
    return before, after, temperature


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="a tlt train run directory")
    parser.add_argument("--samples", type=int, default=8, help="samples per problem at the rollout temperature")
    parser.add_argument("overrides", nargs="*", help="key=value changes to the run's config for this measure")
    args = parser.parse_args()
    if args.samples < 2:
        parser.error("--samples must be >= 2")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the engine's progress lines would bury the table
    before, after, temperature = evaluate(args.run, args.samples, args.overrides)
    print(f"{len(before.greedy)} held-out problems; greedy, and {args.samples} samples each at temperature "
          f"{temperature:g} (the same seeds for both policies)")
    print(f"{'':10s} {'before':>7s} {'after':>7s}   after - before (standard error)")
    for name in ("greedy", "sampled"):
        b, a = getattr(before, name), getattr(after, name)
        gain, error = paired(b, a)
        print(f"{name:10s} {statistics.fmean(b):7.3f} {statistics.fmean(a):7.3f}   {gain:+.3f} ({error:.3f})")
    print(f"sampled answers written 'The answer is N': {before.other_format:.3f} -> {after.other_format:.3f}")


if __name__ == "__main__":
    main()
