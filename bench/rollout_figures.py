"""``tlt bench rollout``'s figures: each mode's speedup over no speculation, paired round by round, on wall time
and on equal work, the fixed depths' step costs per batch-size bucket, and the printout.

The rollouts themselves run in ``bench/rollout_bench.py``; this module is arithmetic on their ``ModeRun`` records
(tests/unit/test_rollout_bench_figures.py runs it on synthetic ones).

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
import statistics
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # bench/ holds scripts, not a package: siblings by name
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from depth_table import format_table  # noqa: E402

from megatron_tlt.config import SpeculationConfig  # noqa: E402

NO_SPECULATION = "no speculation"
BANDIT = "BEG-MAB"
GOODPUT = "goodput"
ADAPTIVE = (BANDIT, GOODPUT)
VLLM_TABLE = "vLLM table"
"""vLLM's static per-batch-size depths (``num_speculative_tokens_per_batch_size``), written from the sweep."""


@dataclasses.dataclass
class ModeRun:
    """One rollout of one mode: its time, tokens and acceptance, its responses and its engine steps."""

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


def tail_seconds(batch_sizes: list[int], step_seconds: list[float]) -> float:
    """Time of the engine steps once at most half the sequences are still generating."""
    if not batch_sizes:
        return 0.0
    half = batch_sizes[0] / 2
    return sum(s for b, s in zip(batch_sizes, step_seconds) if b <= half)


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


def mode_figures(runs: dict[str, list[ModeRun]], bandit_summary: dict, num_prompts: int, *,
                 sampled: bool = False) -> dict:
    """The bench's figures, plain JSON types, from each mode's runs (one per round, the rounds in order) and
    BEG-MAB's summary: speedups over no speculation, the adaptive modes over the best fixed depth, equal work."""
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


def by_bucket(runs: dict[str, list[ModeRun]], settings: SpeculationConfig) -> tuple[dict, dict]:
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


def format_step_costs(step_ms: dict[str, dict[str, float]]) -> list[str]:
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
        lines.extend(format_step_costs(figures["step_ms_by_bucket"]))
    if "equal_work" in figures:
        lines.extend(_format_equal_work(figures["equal_work"]))
    return "\n".join(lines)


def write_figures(figures: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(figures, indent=1))
