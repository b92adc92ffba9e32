"""The ``tlt`` command: the only argv parser in megatron-tlt.

  tlt train [--config NAME|PATH] [--resume RUN_DIR] [key=value ...]   RL training (default: the tiny task)
  tlt warmup-drafter --out DIR [--config NAME|PATH] [--policy RUN|CKPT] [key=value ...]   drafter cold start
  tlt bench rollout [--config NAME|PATH] [--policy RUN|CKPT] [--drafter DIR|RUN] [--depths 1,2,3,4] [key=value ...]
  tlt convert hf-to-mcore --hf DIR --out DIR --tp N --pp M [--dtype float32|bfloat16|float16]
  tlt convert mcore-to-hf --ckpt RUN|CKPT --out DIR
  tlt plan --config NAME|PATH --nodes N --gpus-per-node G [key=value ...]   layout + per-GPU memory
  tlt plan --model CONFIG --nodes N --gpus-per-node G [--tp T --pp P ...]   the same from flags
  tlt export-drafter --ckpt RUN|CKPT --out DIR [--format vllm|sglang]   a serving EAGLE drafter

Bad input ends with one line, ``tlt: error: ...``, naming the problem, and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys

USER_ERROR_EXIT = 2


def _chosen_config(args: argparse.Namespace) -> str:
    """--config, or the one a run of this kind takes (``config.config_name_for``), said in one line."""
    from megatron_tlt.config import config_name_for

    name, note = config_name_for(args.config, args.overrides)
    if note is not None:
        print(f"tlt: {note}", flush=True)
    return name


def _cmd_train(args: argparse.Namespace) -> int:
    if args.help_config:  # the keys, not a run: nothing else is read
        from megatron_tlt.config import describe_keys

        print(describe_keys())
        return 0
    from megatron_tlt.commands.start import start_run

    config_name = args.config if args.resume is not None else _chosen_config(args)
    run_dir, records = start_run(config_name, args.overrides, resume_dir=args.resume)
    if records:
        last = records[-1]
        print(f"tlt train: {last['step']} steps done; last step reward {last['reward_mean']:.3f}, "
              f"accuracy {last['accuracy']:.3f}, rollout idle share {100 * last['rollout_idle_share_mean']:.0f}%")
        before = run_dir / "eval_before_rl.json"
        if "eval/greedy_accuracy" in last and before.is_file():
            import json

            start = json.loads(before.read_text())
            print(f"held-out accuracy before RL -> after: greedy {start['eval/greedy_accuracy']:.3f} -> "
                  f"{last['eval/greedy_accuracy']:.3f}, sampled {start['eval/sampled_accuracy']:.3f} -> "
                  f"{last['eval/sampled_accuracy']:.3f}")
    print(f"run directory: {run_dir} (summary.json, tensorboard/, checkpoints/, logs/: every rank's full output)")
    return 0


def _cmd_warmup_drafter(args: argparse.Namespace) -> int:
    from megatron_tlt.commands.start import start_drafter_warmup, warmup_log_dir
    from megatron_tlt.config import load_config

    # the flags are drafter.cold_start's keys, set after the config's other overrides
    flags = {"prompts": args.prompts, "eval_prompts": args.eval_prompts, "epochs": args.epochs,
             "eval_depth": args.eval_depth}
    overrides = [*args.overrides, *(f"drafter.cold_start.{k}={v}" for k, v in flags.items() if v is not None)]
    settings = load_config(_chosen_config(args), overrides).drafter.cold_start
    announce = (f"tlt warmup-drafter: the policy answers up to {settings.prompts} prompts (and "
                f"{settings.eval_prompts} held out), then the drafter trains {settings.epochs} epochs on its "
                f"responses; every rank's full output in {warmup_log_dir(args.out)}")
    figures = start_drafter_warmup(_chosen_config(args), overrides, policy=args.policy, out_dir=args.out,
                                   announce=announce)
    print(f"tlt warmup-drafter: trained on {figures['tokens_trained']} tokens from {figures['train_prompts']} "
          f"responses of the policy, {figures['epochs']} epochs")
    print(f"held-out ({figures['eval_prompts']} prompts) before -> after: top-1 agreement "
          f"{figures['held_out_top1_agreement_before']:.3f} -> {figures['held_out_top1_agreement_after']:.3f}, "
          f"acceptance length at depth {figures['eval_depth']} (teacher-forced) "
          f"{figures['held_out_acceptance_length_before']:.3f} -> {figures['held_out_acceptance_length_after']:.3f}")
    print(f"wrote the drafter to {args.out} (start a run from it with drafter.init_dir={args.out})")
    return 0


def _cmd_bench_rollout(args: argparse.Namespace) -> int:
    from megatron_tlt.commands.bench_rollout import (RolloutBenchSettings, format_figures, parse_vllm_table,
                                                     write_figures)
    from megatron_tlt.commands.start import start_rollout_bench

    try:
        depths = tuple(int(k) for k in args.depths.split(","))
    except ValueError:
        raise ValueError(f"--depths must be comma-separated integers, got '{args.depths}'") from None
    table = None
    if args.vllm_table is not None:
        table = parse_vllm_table(args.vllm_table)
        if max(depth for _, _, depth in table) > max(depths):
            raise ValueError(f"--vllm-table {args.vllm_table}: a depth above the deepest of --depths ({max(depths)})")
    settings = RolloutBenchSettings(prompts=args.prompts, depths=depths, rounds=args.rounds, sampled=args.sampled,
                                    bandit_warmup_rollouts=args.bandit_warmup, rotate_prompts=not args.same_prompts,
                                    as_a_rank=args.as_a_rank, vllm_table=table)
    figures = start_rollout_bench(_chosen_config(args), args.overrides, policy=args.policy, drafter=args.drafter,
                                  settings=settings)
    print(format_figures(figures))
    if args.json:
        write_figures(figures, args.json)
    return 0


def _cmd_hf_to_mcore(args: argparse.Namespace) -> int:
    from checkpoints_tools.hf_to_mcore import convert_hf_to_mcore

    out = convert_hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, dtype=args.dtype)
    print(f"wrote Megatron checkpoint (TP={args.tp} PP={args.pp}) to {out}")
    return 0


def _cmd_mcore_to_hf(args: argparse.Namespace) -> int:
    from checkpoints_tools.mcore_to_hf import convert_mcore_to_hf
    from megatron_tlt.rl.run.checkpoint_paths import resolve_policy_dir

    ckpt = resolve_policy_dir(args.ckpt)  # a run's latest checkpoint, a checkpoint or a policy checkpoint
    out = convert_mcore_to_hf(ckpt, args.out, max_shard_size=args.max_shard_size)
    print(f"wrote HF model of {ckpt} to {out}")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from megatron_tlt.plan.cli import run

    return run(args)


def _cmd_export_drafter(args: argparse.Namespace) -> int:
    from checkpoints_tools.export_drafter import export_drafter

    source = export_drafter(args.ckpt, args.out, fmt=args.format)
    print(f"wrote the {args.format} EAGLE drafter of {source} to {args.out} (serving flags in {args.out}/README.md)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tlt", description="megatron-tlt: RL for reasoning LLMs with TLT")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="RL-train a policy (no arguments: the embedded tiny default)")
    train.add_argument("--config", default=None, help="config name under launch/configs or a YAML path "
                       "(default: tiny; hf where model.hf_dir is set)")
    train.add_argument("--resume", metavar="RUN_DIR", default=None,
                       help="continue the run in RUN_DIR from its latest checkpoint (its config.yaml is used)")
    train.add_argument("--help-config", action="store_true",
                       help="print every config key with its type, default and meaning, then exit")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. trainer.steps=5")
    train.set_defaults(func=_cmd_train)

    warm = commands.add_parser("warmup-drafter", help="train a drafter offline on the policy's own responses")
    warm.add_argument("--out", required=True, help="new output directory (an EAGLE drafter); every rank's full "
                      "output goes to OUT.logs/")
    warm.add_argument("--config", default=None, help="config name under launch/configs or a YAML path "
                       "(default: tiny; hf where model.hf_dir is set)")
    warm.add_argument("--policy", default=None, metavar="RUN|CKPT",
                      help="policy to distil: a run directory (its latest checkpoint) or a checkpoint "
                           "(default: the config's initial policy)")
    warm.add_argument("--prompts", type=int, help="training prompts, one response each (drafter.cold_start.prompts)")
    warm.add_argument("--eval-prompts", type=int,
                      help="held-out prompts for the before/after figures (drafter.cold_start.eval_prompts)")
    warm.add_argument("--epochs", type=int, help="passes over the responses (drafter.cold_start.epochs)")
    warm.add_argument("--eval-depth", type=int,
                      help="draft depth of the acceptance measurement (drafter.cold_start.eval_depth)")
    warm.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. drafter.lr=3e-3")
    warm.set_defaults(func=_cmd_warmup_drafter)

    bench = commands.add_parser("bench", help="benchmarks of the TLT pieces")
    benches = bench.add_subparsers(dest="bench", required=True)
    rollout = benches.add_parser("rollout", help="one rollout without speculation, at fixed depths and with "
                                                 "BEG-MAB, side by side in one process (greedy, lossless check)")
    rollout.add_argument("--config", default=None, help="config name under launch/configs or a YAML path "
                       "(default: tiny; hf where model.hf_dir is set)")
    rollout.add_argument("--policy", default=None, metavar="RUN|CKPT",
                         help="policy: a run directory or checkpoint (default: the config's initial policy)")
    rollout.add_argument("--drafter", default=None, metavar="DIR|RUN",
                         help="EAGLE drafter directory or a run (its latest drafter checkpoint); default: a "
                              "warm-up drafter of the initial policy, made on first use and cached")
    rollout.add_argument("--prompts", type=int, default=64,
                         help="prompts in the rollout (greedy: one response each; --sampled: rollout.samples_per_prompt)")
    rollout.add_argument("--sampled", action="store_true",
                         help="sample as the RL rollout does (rollout.samples_per_prompt at rollout.temperature) "
                              "instead of greedy; outputs are then not compared token for token")
    rollout.add_argument("--depths", default="1,2,3,4", help="fixed depths to compare (the bandit picks among 0 and these)")
    rollout.add_argument("--rounds", type=int, default=3, help="rounds; each runs every mode once")
    rollout.add_argument("--bandit-warmup", type=int, default=10, metavar="N",
                         help="untimed BEG-MAB rollouts before the timed rounds (it learns across rollouts)")
    rollout.add_argument("--same-prompts", action="store_true",
                         help="run every rollout on the same prompts (default: each takes new held-out prompts)")
    rollout.add_argument("--vllm-table", default=None, metavar="FIRST-LAST:K,...",
                         help="vLLM's static per-batch-size depths to race, e.g. 1-21:4,22-256:2 (default: per "
                              "bucket, the fastest depth of the untimed first round)")
    rollout.add_argument("--all-cores", dest="as_a_rank", action="store_false",
                         help="let the engines use every core (default: the cores and threads one rank of the "
                              "config's run gets, as the launcher pins them on CPU)")
    rollout.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    rollout.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. speculation.epsilon=0.2")
    rollout.set_defaults(func=_cmd_bench_rollout)

    convert = commands.add_parser("convert", help="convert checkpoints between HF and Megatron")
    directions = convert.add_subparsers(dest="direction", required=True)
    to_mcore = directions.add_parser("hf-to-mcore", help="HF safetensors -> Megatron distributed checkpoint")
    to_mcore.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    to_mcore.add_argument("--out", required=True, help="new output directory")
    to_mcore.add_argument("--tp", type=int, default=1, help="tensor parallel size to write at")
    to_mcore.add_argument("--pp", type=int, default=1, help="pipeline parallel size to write at")
    to_mcore.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                          help="parameter dtype (default: that of the HF tensors)")
    to_mcore.set_defaults(func=_cmd_hf_to_mcore)
    to_hf = directions.add_parser("mcore-to-hf", help="Megatron distributed checkpoint -> HF safetensors")
    to_hf.add_argument("--ckpt", required=True, metavar="RUN|CKPT",
                       help="a run directory (its latest checkpoint), a checkpoint or a policy checkpoint")
    to_hf.add_argument("--out", required=True, help="new output directory")
    to_hf.add_argument("--max-shard-size", default="2GB", help="largest safetensors file (e.g. 2GB, 500MB)")
    to_hf.set_defaults(func=_cmd_mcore_to_hf)

    from megatron_tlt.plan import cli as plan_cli

    plan = commands.add_parser("plan", help="check a TP x PP x DP layout and estimate per-GPU memory",
                               description=plan_cli.DESCRIPTION)
    plan_cli.add_arguments(plan)
    plan.set_defaults(func=_cmd_plan)

    export = commands.add_parser("export-drafter", help="write a run's drafter as a vLLM or SGLang EAGLE checkpoint")
    export.add_argument("--ckpt", required=True, metavar="RUN|CKPT",
                        help="a run (its latest drafter), a drafter checkpoint (RUN/drafter/step_N) or a drafter dir")
    export.add_argument("--out", required=True, help="new output directory")
    export.add_argument("--format", choices=["vllm", "sglang"], default="vllm", help="serving engine (default vllm)")
    export.set_defaults(func=_cmd_export_drafter)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    from megatron_tlt.launcher import WorkerFailed, silence_known_dependency_warnings

    silence_known_dependency_warnings()

    try:
        return args.func(args)
    except (ValueError, WorkerFailed) as err:
        print(f"tlt: error: {err}", file=sys.stderr)
        return USER_ERROR_EXIT


if __name__ == "__main__":
    sys.exit(main())
