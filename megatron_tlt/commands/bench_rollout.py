"""``tlt bench rollout``: the long-tail rollout of the tiny default, without and with speculation, in one process.

Two engines hold the same policy side by side: one without speculation (the baseline), one with an EAGLE
drafter and the BEG-MAB scheduler, run either at a pinned depth K (fixed-K speculation), at the depths of a
pinned vLLM per-batch-size table (vLLM's own static rival, written per bucket from the untimed round's sweep),
or with a depth policy (BEG-MAB, goodput) choosing each step's depth. The process runs on the cores and
threads one rank of the config's run gets, as the RL loop's engines do. Every round runs every mode once on
the same prompts, so the modes share the machine's slow and quiet spells. Greedy (the default), their outputs must be identical token for token
(speculation is lossless). ``--sampled`` samples as the RL rollout does (``rollout.samples_per_prompt``
responses per prompt at ``rollout.temperature``): outputs then differ between modes draw by draw, and
losslessness at temperature 1 is the chi-square test's (tests/dist/lossless_sampling.py). Each round takes
the next prompts of the held-out pool, as each RL step takes new ones: a rollout's time hangs on its few
longest sequences, so one fixed prompt set would measure one tail. The
bandit keeps what it learned from round to round, as it does from RL step to RL step; a first, untimed
round of every mode warms the engines, then BEG-MAB learns over a few more untimed rollouts (in an RL run
it learns over hundreds), and its cold first rollout is reported beside the timed ones.

Reported per mode: wall time, generated tokens/s, mean acceptance length, speedup over no speculation, and
the speedup on the long-tail phase (the engine steps after half the sequences have finished).

Sampled, every mode draws its own responses, and a rollout's time hangs on its longest draws: two modes of one
round differed by up to 3x in time on luck alone, so a few rounds could not rank them. The speedups are also
given on equal work: no speculation's time of the round scaled to each mode's own draws, by the ratio of their
plain decoding cost (the steps plain decoding would take for those response lengths, each priced by a line
fitted to no speculation's measured steps by batch size). Longer draws then weigh on both sides alike.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import logging
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path

from megatron_tlt.config import SpeculationConfig, TLTConfig

logger = logging.getLogger(__name__)

NO_SPECULATION = "no speculation"
BANDIT = "BEG-MAB"
GOODPUT = "goodput"
ADAPTIVE = (BANDIT, GOODPUT)
VLLM_TABLE = "vLLM table"
"""vLLM's static per-batch-size depths (``num_speculative_tokens_per_batch_size``), written from the sweep."""


@dataclasses.dataclass(kw_only=True)
class RolloutBenchSettings:
    prompts: int = 64
    """Prompts in the rollout: greedy, one response each (one rank's share of a tiny-default step is 64
    sequences), or, ``sampled``, ``rollout.samples_per_prompt`` each (the default's share is 8 prompts)."""
    sampled: bool = False
    """Sample as the RL rollout does (its samples per prompt, at its temperature) instead of greedy."""
    rotate_prompts: bool = True
    """Each rollout takes the next ``prompts`` of the held-out pool (cycling); False: every rollout runs the
    pool's first ``prompts``."""
    depths: tuple[int, ...] = (1, 2, 3, 4)
    """Fixed depths to compare; the bandit chooses among 0 and these. 0 here runs the speculating engine with
    drafting off, beside the plain engine of "no speculation"."""
    rounds: int = 3
    bandit_warmup_rollouts: int = 10
    """Untimed BEG-MAB rollouts before the timed rounds: in an RL run the bandit learns over hundreds of
    rollouts (its state is kept from step to step); one rollout here has only ~60 engine steps."""
    vllm_table: list[tuple[int, int, int]] | None = None
    """The static table to race (first batch, last batch, depth); None: written per bucket from the fixed
    depths' untimed first round (``spec/depth_table.py``), as a user would from a sweep."""
    as_a_rank: bool = True
    """Run with the cores and threads one rank of the config's run gets (on 2 cores with 2 ranks: one core and
    one thread, as the launcher pins them), not every core: what an engine does in the RL loop."""

    @property
    def rollouts(self) -> int:
        """Distinct prompt sets the bench runs: the warm-up round, the bandit's learning rollouts, the rounds."""
        return 1 + self.bandit_warmup_rollouts + self.rounds


@dataclasses.dataclass
class ModeRun:
    seconds: float
    tokens: int
    tail_seconds: float
    acceptance_length: float
    token_ids: list
    step_batch_sizes: list
    step_seconds: list

    @property
    def response_lengths(self) -> list[int]:
        """Generated tokens of every response: the work plain decoding would have had (``plain_decoding_work``)."""
        return [len(response) for prompt in self.token_ids for response in prompt]


def _tail_seconds(batch_sizes: list[int], step_seconds: list[float]) -> float:
    """Time of the engine steps once at most half the sequences are still generating."""
    if not batch_sizes:
        return 0.0
    half = batch_sizes[0] / 2
    return sum(s for b, s in zip(batch_sizes, step_seconds) if b <= half)


def _run(engine, prompts, sampling) -> ModeRun:
    result = engine.generate(prompts, sampling)
    return ModeRun(result.seconds, result.num_generated_tokens, _tail_seconds(result.step_batch_sizes, result.step_seconds),
                   result.spec.mean_acceptance_length, result.token_ids,
                   result.step_batch_sizes, result.step_seconds)


def bench_on_rank(config: TLTConfig, policy_dir: str | None, drafter_dir: str, settings: RolloutBenchSettings) -> dict:
    """One process: build both engines, run ``rounds`` x every mode, return the figures."""
    from megatron_tlt.drafter import store
    from megatron_tlt.drafter.tlt_drafter import FrozenDrafter
    from megatron_tlt.parallel import ParallelLayout
    from megatron_tlt.rl.rank_session import RankSession
    from megatron_tlt.spec.adaptive_scheduler import depth_policy_for
    from megatron_tlt.spec.engine import SpeculativeSettings

    # K=0 among --depths is the speculating engine with drafting off: what it costs beside the plain engine
    bandit = dataclasses.replace(config.speculation, adaptive=True, depths=sorted({0, *settings.depths}),
                                 policy="bandit")
    speculation = SpeculativeSettings(num_speculative_tokens=max(settings.depths), adaptive=bandit,
                                      seed=config.trainer.seed, draft_sampling=config.speculation.draft_sampling)
    with ParallelLayout(seed=config.trainer.seed), tempfile.TemporaryDirectory(prefix="tlt-bench-rollout-") as workdir:
        session = RankSession(config, policy_dir=Path(policy_dir) if policy_dir is not None else None,
                              show_progress=True)
        task = session.task
        drafter = FrozenDrafter(store.read_drafter_tensors(drafter_dir, task.arch))
        plain = session.open_engine(Path(workdir) / "plain")
        speculative = session.open_engine(Path(workdir) / "spec", speculative=speculation, drafter=drafter)
        try:
            session.sync(plain)
            session.sync(speculative, drafter)
            pool = [e.prompt_ids for e in task.held_out or task.dataset.examples]
            prompt_sets = _prompt_sets(pool, settings.prompts, settings.rotate_prompts)
            greedy = session.sampling(n=1, temperature=0.0, seed=None)
            rollout = greedy
            if settings.sampled:  # the engine's seeded RNG draws (per-request seeds are off while speculating)
                rollout = session.sampling(n=config.rollout.samples_per_prompt, temperature=config.rollout.temperature,
                                           seed=None)
            # One engine, two depth policies, each swapped in for its own rollouts and keeping what it learned.
            policies = {BANDIT: speculative.adaptive_scheduler().bandit,
                        GOODPUT: depth_policy_for(dataclasses.replace(bandit, policy=GOODPUT),
                                                  max(settings.depths), config.trainer.seed)}
            adaptive = list(policies)
            modes = [NO_SPECULATION, *(f"K={k}" for k in settings.depths), VLLM_TABLE, *adaptive]
            runs: dict[str, list[ModeRun]] = {m: [] for m in modes}
            summaries = {}
            table = settings.vllm_table
            for round_index in range(-1, settings.rounds):  # round -1: untimed warm-up
                if round_index == 0:
                    cold = {m: runs[m].pop() for m in adaptive}
                    runs = {m: [] for m in modes}
                    for _ in range(settings.bandit_warmup_rollouts):
                        prompts = next(prompt_sets)
                        for mode in adaptive:
                            speculative.swap_depth_policy(policies[mode])
                            speculative.generate(prompts, rollout)
                prompts = next(prompt_sets)
                for mode in modes:
                    if mode == NO_SPECULATION:
                        runs[mode].append(_run(plain, prompts, rollout))
                        continue
                    if mode == VLLM_TABLE:
                        if table is None:  # from the untimed round only: the timed rounds stay unseen
                            table = _sweep_table(runs, bandit.bucket_bounds, session.engine_config.max_num_seqs)
                        speculative.pin_speculation_depth(None)
                        speculative.pin_speculation_table(table)
                        runs[mode].append(_run(speculative, prompts, rollout))
                        speculative.pin_speculation_table(None)
                        continue
                    if mode in adaptive:
                        speculative.swap_depth_policy(policies[mode])
                    speculative.pin_speculation_depth(None if mode in adaptive else int(mode[2:]))
                    runs[mode].append(_run(speculative, prompts, rollout))
                    if mode in adaptive:
                        summaries[mode] = speculative.bandit_summary()
                logger.info("round %d of %d done", round_index + 1, settings.rounds)
            figures = _figures(runs, summaries[BANDIT], settings.prompts, sampled=settings.sampled)
            figures["goodput"] = summaries[GOODPUT]
            figures["vllm_table"] = [list(entry) for entry in table]
            figures["seconds_by_bucket"], figures["step_ms_by_bucket"] = _by_bucket(runs, bandit)
            base = statistics.fmean(r.seconds for r in runs[NO_SPECULATION])
            figures["bandit_cold_first_rollout_speedup"] = base / cold[BANDIT].seconds
            figures["goodput_cold_first_rollout_speedup"] = base / cold[GOODPUT].seconds
            return figures
        finally:
            session.close()


def _sweep_table(runs: dict[str, list[ModeRun]], bucket_bounds, max_batch: int):
    """vLLM's static table from the last run of each fixed depth. Depth 0 is the speculating engine's own K=0 run
    where --depths has one (the table runs on that engine), else the plain engine's."""
    from megatron_tlt.spec.depth_table import DepthSweepRun, table_from_sweep

    def sweep_run(mode: str) -> DepthSweepRun:
        last = runs[mode][-1]
        return DepthSweepRun(last.step_batch_sizes, last.step_seconds, last.acceptance_length)

    sweep = {0: sweep_run(NO_SPECULATION)}
    sweep.update({int(mode[2:]): sweep_run(mode) for mode in runs if mode.startswith("K=")})
    return table_from_sweep(sweep, bucket_bounds, max_batch)


def _prompt_sets(pool: list, size: int, rotate: bool) -> Iterator[list]:
    """Endless rollouts of ``size`` prompts: consecutive slices of the pool (wrapping round), or its first ``size``."""
    if not pool:
        raise ValueError("tlt bench rollout: the task has no prompts")
    start = 0
    while True:
        yield [pool[(start + i) % len(pool)] for i in range(size)]
        if rotate:
            start = (start + size) % len(pool)


def _standard_error(values: list[float]) -> float:
    """Standard error of the mean of ``values`` (NaN for fewer than two)."""
    return statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")


def _paired_ratios(numerator: list[ModeRun], denominator: list[ModeRun]) -> tuple[list[float], float]:
    """Per round, numerator seconds / denominator seconds (both ran in the same spell of the machine), and
    the standard error of their mean: how far the overall ratio may be noise."""
    by_round = [a.seconds / b.seconds for a, b in zip(numerator, denominator)]
    return by_round, _standard_error(by_round)


def plain_step_line(runs: list[ModeRun]) -> tuple[float, float]:
    """(a, b): a plain engine step over a batch of B sequences takes a + b * B seconds, fitted to the median step
    at each batch size of ``runs`` (weighted by their steps): medians, so the few steps that prefill do not bend it."""
    import numpy as np

    by_batch: dict[int, list[float]] = {}
    for run in runs:
        for batch, seconds in zip(run.step_batch_sizes, run.step_seconds):
            by_batch.setdefault(batch, []).append(seconds)
    if not by_batch:
        raise ValueError("no engine steps to fit the plain step cost to")
    if len(by_batch) == 1:
        (seconds,) = by_batch.values()
        return statistics.median(seconds), 0.0
    batches = sorted(by_batch)
    slope, intercept = np.polyfit(batches, [statistics.median(by_batch[b]) for b in batches], 1,
                                  w=[len(by_batch[b]) ** 0.5 for b in batches])
    return float(intercept), float(slope)


def plain_decoding_work(lengths: list[int], line: tuple[float, float]) -> float:
    """Seconds plain decoding spends on responses of ``lengths`` after their prefill (which gives each its first
    token): a step per further token of the longest, over the responses still growing, priced by ``line``."""
    intercept, slope = line
    ordered = sorted(lengths)
    return sum(intercept + slope * (len(ordered) - bisect.bisect_right(ordered, t))
               for t in range(1, ordered[-1] if ordered else 0))


def _equal_work(runs: dict[str, list[ModeRun]]) -> dict | None:
    """Speedups over no speculation on equal work: per round, no speculation's time scaled by the plain decoding
    work of the mode's own draws over that of its own (None: a run without response lengths)."""
    base = runs[NO_SPECULATION]
    if not all(run.response_lengths for mode_runs in runs.values() for run in mode_runs):
        return None
    line = plain_step_line(base)
    base_work = [plain_decoding_work(run.response_lengths, line) for run in base]
    if min(base_work) <= 0:
        return None
    speedup, by_round, work_ratio = {}, {}, {}
    for mode, mode_runs in runs.items():
        ratios = [plain_decoding_work(run.response_lengths, line) / work for run, work in zip(mode_runs, base_work)]
        plain = [b.seconds * ratio for b, ratio in zip(base, ratios)]
        speedup[mode] = sum(plain) / sum(run.seconds for run in mode_runs)
        by_round[mode] = [seconds / run.seconds for seconds, run in zip(plain, mode_runs)]
        work_ratio[mode] = ratios
    best = max((m for m in speedup if m.startswith("K=")), key=speedup.__getitem__)
    over_best = {}
    for mode in (BANDIT, GOODPUT, VLLM_TABLE):
        if mode in runs:
            ratios = [a / b for a, b in zip(by_round[mode], by_round[best])]
            over_best[mode] = {"ratio": speedup[mode] / speedup[best], "by_round": ratios,
                               "standard_error": _standard_error(ratios)}
    measured = sum(sum(run.step_seconds) for run in base)
    return {"plain_step_seconds": {"intercept": line[0], "per_sequence": line[1]},
            "plain_work_over_measured_steps": sum(base_work) / measured if measured > 0 else float("nan"),
            "speedup": speedup, "speedup_standard_error": {m: _standard_error(v) for m, v in by_round.items()},
            "work_over_no_speculation_by_round": work_ratio, "best_fixed": best, "over_best_fixed": over_best}


def _figures(runs: dict[str, list[ModeRun]], bandit_summary: dict, num_prompts: int, *, sampled: bool = False) -> dict:
    base = runs[NO_SPECULATION]
    base_seconds = sum(r.seconds for r in base)
    base_tail = sum(r.tail_seconds for r in base)
    modes = {}
    for mode, mode_runs in runs.items():
        seconds = sum(r.seconds for r in mode_runs)
        tail = sum(r.tail_seconds for r in mode_runs)
        modes[mode] = {
            "seconds_per_rollout": seconds / len(mode_runs),
            "tokens_per_second": sum(r.tokens for r in mode_runs) / seconds,
            "mean_acceptance_length": statistics.fmean(r.acceptance_length for r in mode_runs),
            "speedup": base_seconds / seconds,
            "long_tail_speedup": base_tail / tail if tail > 0 else float("nan"),
            # Round by round: each round has its own prompts. Sampled, draws differ: not compared.
            "greedy_identical": None if sampled else all(r.token_ids == b.token_ids for r, b in zip(mode_runs, base)),
            "speedup_by_round_standard_error": _paired_ratios(base, mode_runs)[1],
        }
    fixed = [m for m in modes if m.startswith("K=")]
    best_fixed = max(fixed, key=lambda m: modes[m]["speedup"])

    def over_best_fixed(mode: str, key: str) -> dict:
        # Paired by round. The best fixed depth is picked on all rounds, which favours it slightly.
        by_round, error = _paired_ratios(runs[best_fixed], runs[mode])
        return {f"{key}_over_best_fixed": modes[mode]["speedup"] / modes[best_fixed]["speedup"],
                f"{key}_over_best_fixed_by_round": by_round, f"{key}_over_best_fixed_standard_error": error}

    figures = {"prompts": num_prompts, "rounds": len(base), "sampled": sampled, "modes": modes,
               "best_fixed": best_fixed, **over_best_fixed(BANDIT, "bandit"),
               "all_greedy_identical": None if sampled else all(m["greedy_identical"] for m in modes.values()),
               "bandit": bandit_summary}
    for mode, key in ((VLLM_TABLE, "vllm_table"), (GOODPUT, "goodput")):
        if mode in runs:
            figures.update(over_best_fixed(mode, key))
    equal_work = _equal_work(runs)
    if equal_work is not None:
        figures["equal_work"] = equal_work
    return figures


def _format_equal_work(equal_work: dict) -> list[str]:
    speedup, error = equal_work["speedup"], equal_work["speedup_standard_error"]
    line = equal_work["plain_step_seconds"]
    lines = ["on equal work (no speculation's time of each round scaled to each mode's own draws; plain step "
             f"{1000 * line['intercept']:.2f} ms + {1000 * line['per_sequence']:.3f} ms per sequence, "
             f"{equal_work['plain_work_over_measured_steps']:.2f} of no speculation's measured steps):",
             "  speedup: " + ", ".join(f"{mode} {value:.2f}x (+-{error[mode]:.3f})" for mode, value in speedup.items()
                                       if mode != NO_SPECULATION)]
    for mode, over in equal_work["over_best_fixed"].items():
        lines.append(f"  {mode} / best fixed ({equal_work['best_fixed']}): {over['ratio']:.3f}; per round "
                     + ", ".join(f"{r:.3f}" for r in over["by_round"])
                     + f" (standard error of their mean {over['standard_error']:.3f})")
    return lines


def _by_bucket(runs: dict[str, list[ModeRun]], settings: SpeculationConfig) -> tuple[dict, dict]:
    """Per mode and batch-size bucket: engine-step seconds per rollout spent there (where a mode wins), and the
    mean step in milliseconds (what a step costs at that batch: verifying drafts grows with it)."""
    from megatron_tlt.spec.bandit import BucketedEpsilonGreedy

    buckets = BucketedEpsilonGreedy(settings, max_depth=max(settings.depths))
    labels = [buckets.bucket_label(i) for i in range(buckets.num_buckets)]  # smallest batches first
    seconds_per_rollout, step_ms = {}, {}
    for mode, mode_runs in runs.items():
        sums: dict[str, list] = {}  # label: [steps, seconds]
        for run in mode_runs:
            for batch, seconds in zip(run.step_batch_sizes, run.step_seconds):
                cell = sums.setdefault(buckets.bucket_label(buckets.bucket_of(batch)), [0, 0.0])
                cell[0] += 1
                cell[1] += seconds
        in_order = [(label, sums[label]) for label in labels if label in sums]
        seconds_per_rollout[mode] = {label: spent / len(mode_runs) for label, (_, spent) in in_order}
        step_ms[mode] = {label: 1000 * spent / steps for label, (steps, spent) in in_order}
    return seconds_per_rollout, step_ms


def _format_step_costs(step_ms: dict[str, dict[str, float]]) -> list[str]:
    """The fixed depths' step cost per batch-size bucket, in steps of the plain engine at that bucket."""
    plain = step_ms.get(NO_SPECULATION, {})
    lines = [f"mean step per batch-size bucket: {NO_SPECULATION} " + ", ".join(
        f"{label}: {ms:.2f} ms" for label, ms in plain.items())]
    for mode, costs in step_ms.items():
        if mode.startswith("K="):
            lines.append(f"  {mode} in plain steps: " + ", ".join(
                f"{label}: {costs[label] / ms:.2f}" for label, ms in plain.items() if label in costs))
    return lines


def format_figures(figures: dict) -> str:
    sampled = figures.get("sampled", False)
    lines = [f"{'mode':16s} {'s/rollout':>9s} {'tokens/s':>9s} {'accept':>7s} {'speedup':>8s} {'+-se':>6s} "
             f"{'tail':>7s}  {'sampled' if sampled else 'greedy'}"]
    for mode, m in figures["modes"].items():
        outputs = "(draws differ)" if m["greedy_identical"] is None else (
            "identical" if m["greedy_identical"] else "DIFFERENT")
        lines.append(f"{mode:16s} {m['seconds_per_rollout']:9.2f} {m['tokens_per_second']:9.1f} "
                     f"{m['mean_acceptance_length']:7.2f} {m['speedup']:7.2f}x "
                     f"{m.get('speedup_by_round_standard_error', float('nan')):6.3f} "
                     f"{m['long_tail_speedup']:6.2f}x  {outputs}")
    identical = ("sampled: outputs are not compared (the chi-square test covers it)" if sampled else
                 f"greedy outputs identical across all modes: {figures['all_greedy_identical']}")
    lines.append(f"BEG-MAB / best fixed ({figures['best_fixed']}): {figures['bandit_over_best_fixed']:.3f}; "
                 f"{figures['prompts']} prompts x {figures['rounds']} rounds; {identical}")
    lines.append("BEG-MAB / best fixed per round: " + ", ".join(
        f"{r:.3f}" for r in figures["bandit_over_best_fixed_by_round"])
        + f" (standard error of their mean {figures['bandit_over_best_fixed_standard_error']:.3f})")
    from megatron_tlt.spec.depth_table import format_table

    table = format_table([tuple(entry) for entry in figures.get("vllm_table", [])])
    for key, label in (("goodput", f"goodput / best fixed ({figures['best_fixed']})"),
                       ("vllm_table", f"vLLM table ({table}) / best fixed")):
        if f"{key}_over_best_fixed" in figures:
            lines.append(f"{label}: {figures[f'{key}_over_best_fixed']:.3f}; per round "
                         + ", ".join(f"{r:.3f}" for r in figures[f"{key}_over_best_fixed_by_round"])
                         + f" (standard error of their mean {figures[f'{key}_over_best_fixed_standard_error']:.3f})")
    lines.append(f"BEG-MAB's first rollout, before it had tried its arms (untimed): "
                 f"{figures['bandit_cold_first_rollout_speedup']:.2f}x")
    if "goodput_cold_first_rollout_speedup" in figures:
        lines.append(f"goodput's first rollout (untimed): {figures['goodput_cold_first_rollout_speedup']:.2f}x")
    lines.append("BEG-MAB's best depth per batch-size bucket: " + ", ".join(
        f"{bucket}: {v['best']}" for bucket, v in figures["bandit"].items() if v["best"] is not None))
    if "step_ms_by_bucket" in figures:
        lines.extend(_format_step_costs(figures["step_ms_by_bucket"]))
    if "equal_work" in figures:
        lines.extend(_format_equal_work(figures["equal_work"]))
    return "\n".join(lines)


def write_figures(figures: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(figures, indent=1))
