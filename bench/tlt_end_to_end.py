"""End to end: a config (the tiny default, or your own model under `hf`) with TLT fully on (spot trainer + adaptive speculation) vs TLT off, and
beside them the peers' ways of keeping a drafter, with the same speculation:
  * frozen ("pre-RL only"): the drafter of the cold start, never updated (the skeptic's baseline);
  * serial (co-training as NeMo-RL and vime schedule it): after each update the drafter trains on the same
    step's features, on the critical path (``drafter.schedule=serial``), as many rows per rank and step as
    the latest TLT-on run trained in the idle time, so that the two differ only in when they train.

    python bench/tlt_end_to_end.py                       # 40 steps each, the tiny default
    python bench/tlt_end_to_end.py --steps 20 -- rollout.max_response_tokens=256
    python bench/tlt_end_to_end.py --no-frozen --no-serial   # only TLT off and TLT on
    python bench/tlt_end_to_end.py --steps 40 --repeats 2 # off, on, frozen, serial, then reversed: drift cancels
    python bench/tlt_end_to_end.py --no-frozen --variant goodput speculation.policy=goodput   # another TLT-on arm
    python bench/tlt_end_to_end.py --no-serial                       # 5a: online vs frozen from the cold start
    python bench/tlt_end_to_end.py --no-serial --start random        # 5b: a weak start, and the cold start frozen
    python bench/tlt_end_to_end.py --no-serial --start small --start-prompts 256 --start-epochs 2   # 5b: a cheap one
    python bench/tlt_end_to_end.py --no-serial --drift-lr 1e-3       # 5c: a policy that moves far
    python bench/tlt_end_to_end.py --no-off --no-serial --steps 30 --curriculum 10:15   # 5c: a curriculum's switch
    python bench/tlt_end_to_end.py --no-off --no-serial ...          # the drafters only (ratios against 'on')
    python bench/tlt_end_to_end.py --reprint DIR                      # a kept bench's figures again (--keep DIR)

On a pretrained model (``--model-dir`` picks ``launch/configs/hf.yaml``, as ``tlt train model.hf_dir=`` does; the
real-model bench makes SmolLM2-135M-Instruct's directory and word problems: ``bench/real_model.py``):

    python bench/tlt_end_to_end.py --model-dir /tmp/real_model/hf --prompts /tmp/r57/train.jsonl --steps 20 \
        --repeats 2 -- data.reward=exact_match rollout.max_response_tokens=384 trainer.prompts_per_step=8 \
        rollout.samples_per_prompt=4

Weak start (``--start random``): TLT on and the frozen arm start from a randomly initialised drafter (the
seeded initialisation a run without a cold start has), and one more arm, ``cold``, runs the in-domain cold start
kept frozen; its time counts the cold start's own wall time (``--cold-start-seconds``, else measured here by
making one afresh: the separate distillation stage TLT claims to replace). ``--start small`` starts them from a
cold start on a small budget instead (``--start-prompts`` responses, ``--start-epochs`` epochs), made here and
timed: its time counts in every arm that starts from it. Drift (``--drift-lr``): every arm
trains the policy at this learning rate, so that it moves far from where the drafter was cold-started; each
arm's held-out measure (``drafter/quality/*``: the serving drafter and the cold start, on the same step's
policy) is the staleness curve. Curriculum (``--curriculum STEPS:TOKENS``): every arm draws only the prompts of at
most TOKENS tokens for its first STEPS steps, then every prompt (``data.curriculum_steps``,
``data.curriculum_max_prompt_tokens``), and the cold start is made on those first prompts, as a run with that
curriculum makes it: the drafter has seen only the short responses the run starts with, and the policy then writes
long ones.

Both runs use the same seeds and the same number of steps, in every repeat (TLT off draws the same samples each
time, its seed fixes them; TLT on's vary with the engine's RNG under speculation). TLT on starts its drafter from the
benchmarks' cached warm-up drafter of the initial policy (``commands/start.cold_start_drafter``, made on first
use, as ``tlt bench rollout`` does), speculates up to depth ``--depth`` (default: the config's
``drafter.depth``) with the config's depth policy choosing per engine step (the default's
BEG-MAB; ``--variant goodput speculation.policy=goodput`` races the goodput model beside it), and trains
the drafter on idle ranks. The frozen run is TLT on without the spot trainer: its drafter stays the
cold-start one (in-domain, not random), so the acceptance ratio online / frozen is what training on idle
ranks adds. Every arm runs as ``tlt train`` does, its speculation gate included: where the starting drafter's
ceiling is below ``speculation.min_ceiling``, the arms that start from it roll out without drafts, and the report
says so; ``-- speculation.min_ceiling=0`` races speculation itself.
Online against frozen at equal draws: the two arms sample the same distribution but not the same responses, and a
step's time moves with what it drew more than by the 1% a drafter comparison asks for, so beside the plain ratio
the bench fits every step of every run with the step's prompts, the repeat and the draws held fixed
(``bench/equal_samples.py``) and prints the seconds a step the online arm adds, phase by phase, with its SE.
With ``--repeats R`` every arm runs R times, in an order reversed every other repeat (ABBA), so a machine
that drifts slower or faster during the benchmark weighs on every arm alike; times are summed over the
repeats and each repeat's ratio is printed too. Prints the step-time ratio (total and per phase), and the
reward and accuracy curves of
both runs side by side (sampling differs between them: speculative rollouts on CPU draw from the
engine's RNG, so the curves are compared for being within noise, not for equality).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIG = None  # the config every run and the cold start use: --config, else tiny (hf with --model-dir)
BENCH_FILE = "bench.json"  # under --keep's directory: what --reprint reads beside the runs
PHASES = ("rollout_seconds", "logprob_seconds", "update_seconds", "sync_seconds", "step_seconds")
# Rollout shares of a step reported for GPU RL runs (TLT's paper: up to 85%); the step ratio a measured rollout
# ratio gives there is printed beside the measured one, labelled a projection.
GPU_ROLLOUT_SHARES = (0.70, 0.85)


def _run(run_dir: Path, overrides: list[str]) -> list[dict]:
    output = run_dir.with_name(run_dir.name + ".out")  # what tlt train printed: kept, as a failure's only trace
    with open(output, "w") as out:
        done = subprocess.run([sys.executable, "-m", "megatron_tlt.cli", "train", "--config", str(CONFIG),
                               f"trainer.run_dir={run_dir}", *overrides], stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"tlt train exited {done.returncode} ({output}):\n" + output.read_text()[-3000:])
    return json.loads((run_dir / "summary.json").read_text())


def _seconds(runs: dict[str, list[list[dict]]], arm: str, key: str, repeat: int | None = None) -> float:
    """``key`` summed over steps 2.. of every repeat of ``arm`` (or of one): step 1 holds the engines' first-call
    costs in every run, so it is left out of the times."""
    chosen = runs[arm] if repeat is None else [runs[arm][repeat]]
    return sum(r[key] for records in chosen for r in records[1:])


def _repeat_ratios(runs: dict[str, list[list[dict]]], base: str, arm: str, key: str) -> list[float]:
    """``base``'s time over ``arm``'s, repeat by repeat (each repeat's runs of the two arms side by side)."""
    return [_seconds(runs, base, key, i) / _seconds(runs, arm, key, i) for i in range(len(runs[arm]))]


def _mean_records(repeats: list[list[dict]]) -> list[dict]:
    """Per step, the mean over the repeats of the curves the bench prints."""
    keys = ("reward_mean", "accuracy", "spec/mean_acceptance_length")
    return [{key: statistics.fmean(r[key] for r in step) for key in keys if key in step[0]} for step in zip(*repeats)]


def _window_mean(records: list[dict], key: str, start: int, end: int) -> float:
    return statistics.fmean(r[key] for r in records[start:end])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--config", default=None,
                        help="config name under launch/configs or a YAML path (default: tiny; hf with --model-dir)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="a pretrained model's HF directory (model.hf_dir) for every arm and the cold start")
    parser.add_argument("--prompts", type=Path, default=None, help="the prompt file (data.path) of every arm")
    parser.add_argument("--depth", type=int, default=None,
                        help="deepest speculation the depth policy may choose (default: the config's "
                             "drafter.depth)")
    parser.add_argument("--drafter", default=None, help="initial drafter directory (default: the cached warm-up)")
    parser.add_argument("--no-frozen", dest="frozen", action="store_false",
                        help="skip the frozen-drafter run (speculation with the cold-start drafter, no spot training)")
    parser.add_argument("--no-off", dest="off", action="store_false",
                        help="skip the TLT-off run (the comparisons of drafters need only the speculating arms)")
    parser.add_argument("--no-serial", dest="serial", action="store_false",
                        help="skip the serial co-training run (the peers' schedule: the drafter trains after the "
                             "update, on the critical path, as many rows a step as TLT on trained in the idle time)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per arm, in ABBA order (off, on, frozen, frozen, on, off, ...)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep the runs' directories under this one (off-1/, on-1/, frozen-1/, ...) instead of a "
                             "temporary one")
    parser.add_argument("--start", choices=("cold", "random", "small"), default="cold",
                        help="the drafter TLT on and the frozen arm start from: the in-domain cold start (default), "
                             "a random initialisation or a cold start on a small budget (weak starts; each adds the "
                             "arm 'cold', the cold start frozen)")
    parser.add_argument("--start-prompts", type=int, default=256,
                        help="with --start small: the small cold start's training prompts (one response each)")
    parser.add_argument("--start-epochs", type=int, default=2, help="with --start small: its epochs")
    parser.add_argument("--cold-start-seconds", type=float, default=None,
                        help="with --start random: the cold start's wall time, counted in the 'cold' arm's time "
                             "(default: measured by making one afresh, once)")
    parser.add_argument("--drift-lr", type=float, default=None,
                        help="the policy's learning rate in every arm (optimizer.lr): a policy that moves far")
    parser.add_argument("--curriculum", default=None, metavar="STEPS:TOKENS",
                        help="an easy-first curriculum in every arm and the cold start: the first STEPS steps draw "
                             "only prompts of at most TOKENS tokens (e.g. 10:15, up to 3 operations on the tiny task)")
    parser.add_argument("--variant", nargs="+", action="append", default=[], metavar=("NAME", "KEY=VALUE"),
                        help="one more TLT-on arm: a name, then its overrides on top of TLT on's, e.g. --variant "
                             "goodput speculation.policy=goodput (repeatable; put the shared overrides after --)")
    parser.add_argument("--reprint", type=Path, default=None, metavar="DIR",
                        help="run nothing: print a finished bench's figures again from the directory it kept "
                             "(--keep), with what the bench prints now")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for both runs")
    args = parser.parse_args()
    if args.reprint is not None:
        return _reprint(args.reprint)
    if args.repeats < 1 or args.steps < 2:
        parser.error("--repeats must be >= 1 and --steps >= 2 (step 1 is left out of the times)")
    for flag, path in (("--model-dir", args.model_dir), ("--prompts", args.prompts)):
        if path is not None and not path.exists():
            parser.error(f"{flag} {path}: no such file or directory")
    if args.model_dir is not None:
        args.overrides = [f"model.hf_dir={args.model_dir.resolve()}", *args.overrides]
    if args.prompts is not None:
        args.overrides = [f"data.path={args.prompts.resolve()}", *args.overrides]
    global CONFIG
    from megatron_tlt.config.loading import config_name_for

    CONFIG, _ = config_name_for(args.config, args.overrides)
    print(f"config {CONFIG}; every arm: {' '.join(args.overrides) or 'no overrides'}", flush=True)
    variants = {name: extra for name, *extra in args.variant}
    if len(variants) != len(args.variant) or {"off", "on", "frozen", "serial", "cold"} & set(variants):
        parser.error("--variant names must be distinct and none of off, on, frozen, serial, cold")
    if args.drift_lr is not None:
        args.overrides = [*args.overrides, f"optimizer.lr={args.drift_lr}"]
    if args.curriculum is not None:
        steps, _, tokens = args.curriculum.partition(":")
        if not (steps.isdigit() and tokens.isdigit() and 0 < int(steps) < args.steps and int(tokens) > 0):
            parser.error(f"--curriculum must be STEPS:TOKENS with 0 < STEPS < --steps, got '{args.curriculum}'")
        args.overrides = [*args.overrides, f"data.curriculum_steps={steps}",
                          f"data.curriculum_max_prompt_tokens={tokens}"]
    if args.depth is None:  # the default's own depth, so that the bench measures what `tlt train` runs
        from megatron_tlt.config import load_config

        args.depth = load_config(CONFIG, args.overrides).drafter.depth
    if args.depth < 1:
        parser.error(f"--depth must be >= 1 (TLT on speculates), got {args.depth}")
    if args.drafter is None:
        from megatron_tlt.commands.start import cold_start_drafter

        args.drafter = str(cold_start_drafter(CONFIG, args.overrides))
    common = [f"trainer.steps={args.steps}", "trainer.eval_every=0", "trainer.save_every=0", *args.overrides]
    # Both arms say what they are: the default has TLT on, and an override may change that.
    tlt_off = ["drafter.depth=0", "drafter.spot_training=false"]
    speculating = [f"drafter.depth={args.depth}", "speculation.adaptive=true"]
    in_domain = [f"drafter.init_dir={args.drafter}"]
    start_seconds = 0.0  # what the weak start took to make, counted in the time of every arm that starts from it
    if args.start == "cold":
        start = in_domain
    elif args.start == "random":
        start = ["drafter.init_dir=null", "drafter.cold_start.enabled=false"]
    else:
        small_dir, start_seconds = _make_a_small_cold_start(args)
        start = [f"drafter.init_dir={small_dir}"]
    tlt_on = speculating + ["drafter.spot_training=true"] + start
    arms = {"off": common + tlt_off} if args.off else {}
    arms["on"] = common + tlt_on
    if args.frozen:
        arms["frozen"] = common + tlt_on + ["drafter.spot_training=false"]
    cold_start_seconds = 0.0
    if args.start != "cold":  # the in-domain cold start, frozen: what TLT from a weak start must beat
        arms["cold"] = common + speculating + ["drafter.spot_training=false"] + in_domain
        cold_start_seconds = args.cold_start_seconds
        if cold_start_seconds is None:
            cold_start_seconds = _time_a_cold_start(args.overrides)
    if args.serial:  # its rows per step are TLT on's of the latest run, known only then (_serial_tokens)
        arms["serial"] = common + tlt_on + ["drafter.schedule=serial"]
    arms |= {name: common + tlt_on + extra for name, extra in variants.items()}
    runs: dict[str, list[list[dict]]] = {arm: [] for arm in arms}
    with contextlib.ExitStack() as stack:
        root = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        root.mkdir(parents=True, exist_ok=True)
        # What --reprint needs beside the runs' summaries: the starts' own times and which arms are variants.
        (root / BENCH_FILE).write_text(json.dumps({"start": args.start, "start_seconds": start_seconds,
                                                   "cold_start_seconds": cold_start_seconds,
                                                   "variants": list(variants)}, indent=1))
        for repeat in range(args.repeats):
            for arm in (list(arms) if repeat % 2 == 0 else list(arms)[::-1]):  # "on" runs before "serial" first
                extra = [f"drafter.serial_tokens={_serial_tokens(runs['on'][-1])}"] if arm == "serial" else []
                runs[arm].append(_run(root / f"{arm}-{repeat + 1}", arms[arm] + extra))
    _print_all(runs, list(variants), cold_start_seconds, start_seconds, args.start)


def _reprint(root: Path) -> None:
    """The printout of a finished bench again, from the run directories it kept (``--keep``), with the figures
    added since it ran: ``root/{arm}-{repeat}/summary.json``, and ``root/bench.json`` where it wrote one."""
    found = {}  # (arm, repeat) -> its summary, from the directories named ARM-REPEAT
    for path in root.glob("*-*/summary.json"):
        arm, _, repeat = path.parent.name.rpartition("-")
        if repeat.isdigit():
            found[arm, int(repeat)] = path
    if not found:
        raise SystemExit(f"--reprint: no ARM-REPEAT/summary.json under {root} (a directory kept with --keep)")
    runs: dict[str, list[list[dict]]] = {}
    for (arm, _), path in sorted(found.items()):
        runs.setdefault(arm, []).append(json.loads(path.read_text()))
    if len({len(repeats) for repeats in runs.values()}) != 1:
        raise SystemExit(f"--reprint: the arms under {root} ran different numbers of repeats "
                         f"({ {arm: len(r) for arm, r in runs.items()} }): an interrupted bench")
    meta = json.loads((root / BENCH_FILE).read_text()) if (root / BENCH_FILE).exists() else {}
    order = {"off": 0, "on": 1, "frozen": 2, "cold": 3, "serial": 4}  # the bench's own order; variants after
    runs = dict(sorted(runs.items(), key=lambda item: order.get(item[0], len(order))))
    _print_all(runs, [arm for arm in runs if arm not in order], meta.get("cold_start_seconds", 0.0),
               meta.get("start_seconds", 0.0), meta.get("start", "cold"))


def _print_all(runs: dict[str, list[list[dict]]], variants: list[str], cold_start_seconds: float,
               start_seconds: float, start: str) -> None:
    steps = len(next(iter(runs.values()))[0])
    half = steps // 2
    if "off" in runs:
        _print_against_off(runs, len(runs["off"]), steps, half)
    if "frozen" in runs:
        _print_frozen_baseline(runs, half)
        for arm in [a for a in runs if a not in ("off", "frozen", "cold")]:
            _print_at_equal_draws(runs, "frozen", arm)
    for name in variants:
        _print_variant(runs, name)
    _print_arms(runs, half)
    _print_speculation_verdicts(runs)
    _print_where_the_time_went(runs)
    _print_quality(runs)
    if "cold" in runs:
        _print_weak_start(runs, cold_start_seconds, start_seconds, start)
    if "off" in runs:
        total = _seconds(runs, "off", "step_seconds") / _seconds(runs, "on", "step_seconds")
        print(f"end-to-end step time, TLT off / on over steps 2-{steps}: {total:.3f}x")
        rollout = _seconds(runs, "off", "rollout_seconds") / _seconds(runs, "on", "rollout_seconds")
        for share in GPU_ROLLOUT_SHARES:  # the other phases held as they are: Amdahl on the rollout's ratio
            print(f"  projection, not a measurement: at a rollout share of {share:.0%} of a TLT-off step (a GPU "
                  f"run's), this rollout ratio {rollout:.3f}x gives a step ratio of "
                  f"{1 / ((1 - share) + share / rollout):.3f}x")


def _print_against_off(runs: dict[str, list[list[dict]]], repeats: int, steps: int, half: int) -> None:
    """TLT on (and frozen) against TLT off: phase times, per-repeat step ratios, reward and accuracy curves."""
    def seconds(arm: str, key: str, repeat: int | None = None) -> float:
        return _seconds(runs, arm, key, repeat)

    for key in PHASES:
        a, b = seconds("off", key), seconds("on", key)
        line = f"  {key:16s} TLT off {a:8.2f}s  TLT on {b:8.2f}s  speedup {a / b:5.2f}x"
        if "frozen" in runs:
            c = seconds("frozen", key)
            line += f"   frozen {c:8.2f}s  speedup {a / c:5.2f}x"
        print(line)
    if repeats > 1:
        ratios = _repeat_ratios(runs, "off", "on", "step_seconds")
        print("  step time TLT off / on per repeat: " + ", ".join(f"{r:.3f}x" for r in ratios) +
              f"; mean {statistics.fmean(ratios):.3f}x (SE {statistics.stdev(ratios) / len(ratios) ** 0.5:.3f})")
    off, on = _mean_records(runs["off"]), _mean_records(runs["on"])
    rollout_share = seconds("off", "rollout_seconds") / seconds("off", "step_seconds")
    print(f"  rollout share of a TLT-off step: {rollout_share:.1%}")
    print(f"  step   reward off / on    accuracy off / on    acceptance (TLT on), means over {repeats} repeat(s)")
    chunk = max(1, steps // 8)
    for start in range(0, steps, chunk):
        end = min(start + chunk, steps)
        accept = [r.get("spec/mean_acceptance_length", float("nan")) for r in on[start:end]]
        print(f"  {start + 1:3d}-{end:<3d} {_window_mean(off, 'reward_mean', start, end):.3f} / "
              f"{_window_mean(on, 'reward_mean', start, end):.3f}      "
              f"{_window_mean(off, 'accuracy', start, end):.3f} / {_window_mean(on, 'accuracy', start, end):.3f}"
              f"          {statistics.fmean(accept):.2f}")
    print(f"  last {steps - half} steps: reward off {_window_mean(off, 'reward_mean', half, steps):.3f}, "
          f"on {_window_mean(on, 'reward_mean', half, steps):.3f}" + (
              f"; reward std over steps (off, repeat 1) {statistics.stdev(r['reward_mean'] for r in off_tail):.3f}"
              if len(off_tail := runs["off"][0][half:]) > 1 else ""))
    if repeats > 1:  # paired: each repeat's TLT on against its TLT off, on the same prompts
        gaps = [_window_mean(b, "reward_mean", half, steps) - _window_mean(a, "reward_mean", half, steps)
                for a, b in zip(runs["off"], runs["on"])]
        print(f"  reward on - off over those steps, per repeat: mean {statistics.fmean(gaps):+.3f} "
              f"(SE {statistics.stdev(gaps) / len(gaps) ** 0.5:.3f})")


def _print_frozen_baseline(runs: dict[str, list[list[dict]]], half: int) -> None:
    """Online vs frozen drafter over the second half of the steps (every repeat), where the policy has moved on."""
    def acceptance(arm: str) -> float:
        return statistics.fmean(r.get("spec/mean_acceptance_length", float("nan"))
                                for records in runs[arm] for r in records[half:])

    online, still = acceptance("on"), acceptance("frozen")
    print(f"  acceptance length, steps {half + 1}-{len(runs['on'][0])}: online drafter {online:.2f}, frozen after the "
          f"cold start {still:.2f}: ratio {online / still:.3f}x (accepted draft tokens: "
          f"{(online - 1) / (still - 1):.3f}x)")
    if "off" not in runs:
        return
    print(f"  step time TLT off / frozen drafter: "
          f"{_seconds(runs, 'off', 'step_seconds') / _seconds(runs, 'frozen', 'step_seconds'):.3f}x; rollout "
          f"{_seconds(runs, 'off', 'rollout_seconds') / _seconds(runs, 'frozen', 'rollout_seconds'):.3f}x")


def _print_at_equal_draws(runs: dict[str, list[list[dict]]], base: str, arm: str) -> None:
    """``arm`` against ``base`` at equal draws (``bench/equal_samples.py``), phase by phase: base / arm with the step's
    prompts, the repeat and its draws held fixed, and the same at the runs' own machine speed, fitted repeat by
    repeat (mean and SE over repeats: the runs' own noise in it). Beside it what the spot trainer cost the
    generating rank, as it measured it in the run (``drafter/spot_rollout_cost``)."""
    from equal_samples import PHASE_COVARIATES, arm_effect, mean_ratio, repeat_effects

    print(f"  {arm} against {base} at equal draws ({base}'s time / {arm}'s; seconds {arm} adds a step):")
    for phase in PHASE_COVARIATES:
        try:
            pooled = arm_effect(runs[base], runs[arm], phase)
            at_speed = repeat_effects(runs[base], runs[arm], phase, at_machine_speed=True)
        except ValueError as err:  # too few steps or repeats for the effects: say so, print the rest
            print(f"    {phase}: {err}")
            return
        mean, se = mean_ratio(at_speed)
        print(f"    {phase.removesuffix('_seconds'):8s} {pooled.ratio:.3f}x ({pooled.seconds:+.3f} s, SE {pooled.standard_error:.3f}"
              f" over {pooled.rows} steps); at each run's machine speed, per repeat "
              + ", ".join(f"{e.ratio:.3f}x" for e in at_speed) + f": mean {mean:.3f}x"
              + (f" (SE {se:.3f})" if se is not None else ""))
    costs = [r["drafter/spot_rollout_cost"] for records in runs[arm] for r in records[1:]
             if r.get("drafter/spot_rollout_cost") is not None]
    if costs:
        print(f"  {arm}: spot training's cost to the generating rank, as measured in the run: mean {statistics.fmean(costs):.2%}"
              f", most {max(costs):.2%} of its generating time ({len(costs)} steps with an estimate)")


def _serial_tokens(tlt_on: list[dict]) -> int:
    """Drafter rows per rank per step that a TLT-on run trained in the idle time (steps 2..): the serial arm's
    budget, so that both train the drafter on as many rows and differ only in when."""
    per_rank = [t for r in tlt_on[1:] for t in r.get("drafter/tokens_trained", [])]
    return max(1, round(statistics.fmean(per_rank))) if per_rank else 1


def _present_mean(records: list[dict], key: str, start: int, end: int) -> float:
    """``key``'s mean over ``records[start:end]`` that hold it (NaN where none does): the rollout's acceptance is
    absent from steps that drafted nothing, the held-out measure from steps that did not measure."""
    values = [r[key] for r in records[start:end] if r.get(key) is not None]
    return statistics.fmean(values) if values else float("nan")


def _acceptance(records: list[dict], start: int, end: int) -> float:
    return _present_mean(records, "spec/mean_acceptance_length", start, end)


def _print_arms(runs: dict[str, list[list[dict]]], half: int) -> None:
    """Every arm against TLT off side by side: step and rollout time ratios (per repeat, mean and SE),
    acceptance length, drafter rows trained a step, and reward; then acceptance over the run, per arm."""
    def per_repeat(base: str, arm: str, key: str) -> str:
        ratios = _repeat_ratios(runs, base, arm, key)
        se = f" SE {statistics.stdev(ratios) / len(ratios) ** 0.5:.3f}" if len(ratios) > 1 else ""
        return f"{statistics.fmean(ratios):.3f}x{se}"

    base = "off" if "off" in runs else next(iter(runs))
    steps = len(runs[base][0])
    print(f"  per arm, steps 2-{steps}, every repeat (ratios: {base}'s time / the arm's, mean over repeats):")
    print(f"  {'arm':8s} {'step':>18s} {'rollout':>18s} {'acceptance':>10s} {'rows/step':>10s} {'reward, 2nd half':>17s}")
    for arm, repeats in runs.items():
        rows = [sum(r.get("drafter/tokens_trained", [0])) for records in repeats for r in records[1:]]
        reward = statistics.fmean(_window_mean(records, "reward_mean", half, steps) for records in repeats)
        accept = statistics.fmean(_acceptance(records, 1, steps) for records in repeats)
        print(f"  {arm:8s} {per_repeat(base, arm, 'step_seconds'):>18s} {per_repeat(base, arm, 'rollout_seconds'):>18s}"
              f" {accept:10.2f} {statistics.fmean(rows):10.0f} {reward:17.3f}")
    if "serial" in runs:
        print(f"  step time serial co-training / TLT on: {per_repeat('serial', 'on', 'step_seconds')}; rollout "
              f"{per_repeat('serial', 'on', 'rollout_seconds')}")
    speculating = [arm for arm in runs if arm != "off"]
    chunk = max(1, steps // 8)
    print("  acceptance length by steps, mean over repeats: " + ", ".join(speculating))
    for start in range(0, steps, chunk):
        end = min(start + chunk, steps)
        print(f"  {start + 1:3d}-{end:<3d} " + "  ".join(
            f"{statistics.fmean(_acceptance(records, start, end) for records in runs[arm]):6.2f}" for arm in speculating))


def _print_speculation_verdicts(runs: dict[str, list[list[dict]]]) -> None:
    """Each arm that started from a drafter: whether its engines speculated with it (``spec/served``, the run's
    verdict on the drafter's ceiling: commands/speculation_gate.py)."""
    for arm, repeats in runs.items():
        verdicts = [(rs[0].get("spec/served"), rs[0].get("spec/drafter_ceiling")) for rs in repeats]
        if all(served is None for served, _ in verdicts):
            continue
        served, ceiling = verdicts[0]
        what = "speculated" if served else "rolled out without drafts (speculation.min_ceiling=0 speculates anyway)"
        print(f"  {arm}: {what}; the starting drafter's ceiling "
              + (f"{ceiling:.2f}x" if ceiling is not None else "not judged (speculation_verdict.json says why)")
              + ("" if len(set(verdicts)) == 1 else f" (repeats differ: {verdicts})"))


def _print_where_the_time_went(runs: dict[str, list[list[dict]]]) -> None:
    """Per arm, over steps 2.. of every repeat: each phase's share of the step, the responses cut at the length
    cap, the rollout's idle share and what the spot trainer did in it, acceptance per draft position, and how
    often each depth ran with the depth policy's best depth per batch-size bucket at the last step."""
    def mean(records: list[dict], key: str) -> float:
        values = [r[key] for r in records if r.get(key) is not None]
        return statistics.fmean(values) if values else float("nan")

    print("  where the time went, steps 2.. of every repeat (phase shares of the step; cap: responses at the length "
          "cap; idle: the rollout's idle share)")
    for arm, repeats in runs.items():
        records = [r for rs in repeats for r in rs[1:]]
        step = sum(r["step_seconds"] for r in records)
        shares = ", ".join(f"{key.removesuffix('_seconds')} {sum(r.get(key, 0.0) for r in records) / step:.0%}"
                           for key in ("rollout_seconds", "reward_seconds", *PHASES[1:-1]))
        line = (f"  {arm:8s} {shares}; cap {mean(records, 'truncated_share'):.1%}; "
                f"idle {mean(records, 'rollout_idle_share_mean'):.1%}")
        trained = [sum(r.get("drafter/tokens_trained", [])) for r in records]
        if any(trained):  # per rank: seconds the spot trainer ran inside the rollout, rows it trained
            seconds = statistics.fmean(statistics.fmean(r.get("rollout_training_seconds") or [0.0]) for r in records)
            line += f"; spot training {seconds:.1f} s a rank and {statistics.fmean(trained):.0f} rows a step"
        print(line)
        positions = [r["spec/acceptance_per_position"] for r in records if r.get("spec/acceptance_per_position")]
        if positions:
            per_position = [statistics.fmean(p[i] for p in positions if len(p) > i)
                            for i in range(max(map(len, positions)))]
            depths: dict[str, int] = {}
            for r in records:
                for depth, count in (r.get("spec/engine_steps_by_depth") or {}).items():
                    depths[depth] = depths.get(depth, 0) + count
            best = next((r["spec/best_depth_by_bucket"] for r in reversed(records) if r.get("spec/best_depth_by_bucket")),
                        None)
            print(f"  {'':8s} acceptance per position " + " ".join(f"{p:.3f}" for p in per_position)
                  + f"; engine steps by depth {dict(sorted(depths.items(), key=lambda kv: int(kv[0])))}"
                  + (f"; best depth by batch bucket at the last step {best}" if best else ""))


def _time_a_cold_start(overrides: list[str]) -> float:
    """Wall seconds of making the config's cold-start drafter afresh (in a temporary directory, not the cache)."""
    with tempfile.TemporaryDirectory() as directory:
        _, seconds = _make_a_cold_start(overrides, Path(directory) / "drafter", "the cold start (made afresh)")
    return seconds


def _make_a_small_cold_start(args) -> tuple[str, float]:
    """A cold start on a small budget (a weak start), made and timed under the bench's directory."""
    out_dir = Path(args.keep or tempfile.mkdtemp()) / f"small-start-{args.start_prompts}x{args.start_epochs}"
    return _make_a_cold_start(args.overrides, out_dir,
                              f"the small cold start ({args.start_prompts} prompts, {args.start_epochs} epochs)",
                              prompts=args.start_prompts, epochs=args.start_epochs)


def _make_a_cold_start(overrides: list[str], out_dir: Path, label: str, **budget) -> tuple[str, float]:
    """Make the config's cold start (its budget replaced by ``budget``) into ``out_dir``; print and return its wall
    seconds beside what it reached."""
    import time

    from megatron_tlt.commands.start import start_drafter_warmup

    overrides = [*overrides, *(f"drafter.cold_start.{key}={value}" for key, value in budget.items())]
    started = time.perf_counter()
    figures = start_drafter_warmup(CONFIG, overrides, policy=None, out_dir=str(out_dir))
    seconds = time.perf_counter() - started
    print(f"  {label} took {seconds:.1f} s; held-out top-1 agreement {figures['held_out_top1_agreement_after']:.3f}, "
          f"acceptance length {figures['held_out_acceptance_length_after']:.2f} at its measuring depth (teacher-forced)", flush=True)
    return str(out_dir), seconds


def _print_quality(runs: dict[str, list[list[dict]]]) -> None:
    """Each speculating arm's serving drafter measured apart from the rollout (``drafter/quality/*``: teacher-forced
    expected acceptance length at the engine's depth on a held-out slice of each step's rollouts), beside the cold
    start on the same rows, by windows of steps; then online / frozen on it, the depth BEG-MAB chose held fixed."""
    arms = [arm for arm in runs if any("drafter/quality/expected_acceptance_length" in r for r in runs[arm][0])]
    if not arms:
        return
    steps = len(runs[arms[0]][0])
    chunk = max(1, steps // 8)
    print("  held-out expected acceptance length of the serving drafter (cold start on the same rows), mean over "
          "repeats: " + ", ".join(arms))
    for start in range(0, steps, chunk):
        end = min(start + chunk, steps)
        cells = []
        for arm in arms:
            serving = statistics.fmean(_present_mean(r, "drafter/quality/expected_acceptance_length", start, end)
                                       for r in runs[arm])
            cold = statistics.fmean(
                _present_mean(r, "drafter/quality/cold_start_expected_acceptance_length", start, end) for r in runs[arm])
            cells.append(f"{serving:5.2f} ({cold:5.2f})")
        if all("nan" in cell for cell in cells):  # no step of the window measured (drafter.quality_every)
            continue
        print(f"  {start + 1:3d}-{end:<3d} " + "  ".join(cells))
    last = max(0, steps - 20)
    for online, frozen in (("on", "frozen"), ("on", "cold")):
        if online in arms and frozen in arms:
            ratios = [_present_mean(a, "drafter/quality/expected_acceptance_length", last, steps)
                      / _present_mean(b, "drafter/quality/expected_acceptance_length", last, steps)
                      for a, b in zip(runs[online], runs[frozen])]
            se = f" (SE {statistics.stdev(ratios) / len(ratios) ** 0.5:.3f})" if len(ratios) > 1 else ""
            print(f"  held-out acceptance {online} / {frozen}, steps {last + 1}-{steps}: "
                  f"{statistics.fmean(ratios):.3f}x{se}")
    for arm in arms:  # paired on the same rows and policy: the serving drafter over the cold start, within an arm
        ratios = [statistics.fmean(r["drafter/quality/expected_acceptance_length"]
                                   / r["drafter/quality/cold_start_expected_acceptance_length"]
                                   for r in records[last:] if r.get("drafter/quality/expected_acceptance_length"))
                  for records in runs[arm]]
        print(f"  {arm}: serving / cold start on the same held-out rows, steps {last + 1}-{steps}: "
              f"{statistics.fmean(ratios):.3f}x")
    if "on" in arms:
        # the counts of the last step that measured (drafter.quality_every: not every step decides a push)
        pushes = [next(((r["drafter/pushes"], r["drafter/pushes_declined"]) for r in reversed(records)
                        if "drafter/pushes" in r), (0, 0)) for records in runs["on"]]
        print("  TLT on's push gate, per repeat (pushed, declined): " + ", ".join(f"{p}/{d}" for p, d in pushes))


def _print_weak_start(runs: dict[str, list[list[dict]]], cold_start_seconds: float, start_seconds: float,
                      start: str) -> None:
    """Each online arm from the weak start against the in-domain cold start frozen, each start's own time counted:
    the time from nothing to the last step, and the step at which the online drafter first reaches the frozen cold
    start's held-out acceptance (its mean over the run)."""
    key = "drafter/quality/expected_acceptance_length"
    online_arms = [arm for arm in runs if arm not in ("off", "frozen", "cold")
                   and any(r.get("drafter/tokens_trained") for r in runs[arm][0])]
    for arm in online_arms:
        for repeat, (online, cold) in enumerate(zip(runs[arm], runs["cold"]), start=1):
            target = _present_mean(cold, key, 0, len(cold))
            reached = next((r["step"] for r in online if r.get(key) is not None and r[key] >= target), None)
            measured = [r[key] for r in online if r.get(key) is not None]  # not every step measures
            last = measured[-1] if measured else float("nan")
            tlt_time = sum(r["step_seconds"] for r in online) + start_seconds
            cold_time = sum(r["step_seconds"] for r in cold) + cold_start_seconds
            print(f"  {arm}, repeat {repeat}: from the {start} start ({online[0].get(key, float('nan')):.2f} at step 1) "
                  f"it reached the cold start's held-out acceptance ({target:.2f}) at step "
                  f"{reached if reached is not None else 'never'} (last measured {last:.2f}); time "
                  f"to step {len(online)}: {tlt_time:.0f} s ({start_seconds:.0f} s of it making the start), cold "
                  f"start + frozen {cold_time:.0f} s ({cold_start_seconds:.0f} s of it the cold start): "
                  f"{cold_time / tlt_time:.3f}x")


def _print_variant(runs: dict[str, list[list[dict]]], name: str) -> None:
    """A --variant arm against TLT off and TLT on: step and rollout time ratios, per repeat with their spread."""
    for base in [b for b in ("off", "on") if b in runs]:
        ratios = _repeat_ratios(runs, base, name, "step_seconds")
        spread = f" (SE {statistics.stdev(ratios) / len(ratios) ** 0.5:.3f})" if len(ratios) > 1 else ""
        step = _seconds(runs, base, "step_seconds") / _seconds(runs, name, "step_seconds")
        rollout = _seconds(runs, base, "rollout_seconds") / _seconds(runs, name, "rollout_seconds")
        print(f"  step time {base} / {name}: {step:.3f}x, per repeat mean {statistics.fmean(ratios):.3f}x{spread}; "
              f"rollout {rollout:.3f}x")


if __name__ == "__main__":
    main()
