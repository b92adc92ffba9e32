"""The ``tlt plan`` command: the same config keys as ``tlt train``, flags on top, and the printed plan.

    tlt plan --config llama3_70b_8x8 --nodes 8 --gpus-per-node 8 [key=value ...]
    tlt plan --model llama-3.3-70b --nodes 8 --gpus-per-node 8 [--tp 8 --pp 4 ...]

With ``--config`` the layout (``parallel.*``), the sequence (``data.max_prompt_tokens +
rollout.max_response_tokens``), the micro-batch, how the policy is built (``model.attention``,
``model.dtype``, ``trainer.recompute``, ``parallel.sequence_parallel``, ``optimizer.distributed``), the
drafter and the engine's share of the GPU are the config's, loaded and validated by ``config.load_config``
as ``tlt train`` loads them, so a config ``tlt train`` refuses is refused here with its words. Flags that
name a config key become overrides of it; the others (``--gpu-memory-gib``, ``--seq-len``, ...) set the
plan directly. Without ``--config`` the flags and ``PlanOptions``' defaults describe the job, and a layout
not given is searched.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from megatron_tlt.formats.architecture import ModelConfigError
from megatron_tlt.model.build_options import ATTENTIONS, RECOMPUTES
from megatron_tlt.plan.checks import cluster_name
from megatron_tlt.plan.memory import DTYPE_BYTES
from megatron_tlt.plan.model import PlanError, count_parameters, resolve_hf_dir, resolve_model
from megatron_tlt.plan.search import PHASES, LayoutPlan, PlanOptions, plan_layout, require_fit, search_layouts

DESCRIPTION = "Choose a TP/PP/DP layout for a model on a cluster and estimate memory per GPU."

# flag (argparse dest) -> the config key it overrides under --config
CONFIG_KEYS = {
    "tp": "parallel.tensor_parallel_size",
    "pp": "parallel.pipeline_parallel_size",
    "micro_batch_size": "trainer.micro_batch_size",
    "dtype": "model.dtype",
    "attention": "model.attention",
    "recompute": "trainer.recompute",
    "sequence_parallel": "parallel.sequence_parallel",
    "distributed_optimizer": "optimizer.distributed",
    "engine_tp": "rollout.engine.tensor_parallel_size",
    "gpu_memory_utilization": "rollout.engine.gpu_memory_utilization",
    "drafter_buffer_tokens": "drafter.buffer_tokens",
    "drafter_pack_tokens": "drafter.pack_tokens",
}
# flags that set PlanOptions fields of the same name directly
DIRECT_OPTIONS = ("gpu_memory_gib", "seq_len", "sleep_level", "drafter", "drafter_bytes_per_param", "overhead_gib")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tlt plan`` (the ``tlt`` parser adds them to its ``plan`` subcommand). Defaults are
    None: a flag given overrides the config; one not given leaves the config's value (or ``PlanOptions``')."""
    d = PlanOptions()
    parser.add_argument("--config", help="config name under launch/configs or a YAML path, as for tlt train")
    parser.add_argument("--model", help="HF model directory, its config.json, or a name under launch/models "
                                        "(e.g. llama-3.3-70b); with --config, default: model.hf_dir")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, required=True)
    parser.add_argument("--tp", type=int, help="tensor-parallel size (default: the config's, else searched)")
    parser.add_argument("--pp", type=int, help="pipeline-parallel size (default: the config's, else searched)")
    parser.add_argument("--gpu-memory-gib", type=float, help=f"GPU memory (default {d.gpu_memory_gib:g})")
    parser.add_argument("--micro-batch-size", type=int, help=f"sequences per micro-batch (default {d.micro_batch_size})")
    parser.add_argument("--seq-len", type=int, help=f"prompt + response tokens (default {d.seq_len})")
    parser.add_argument("--dtype", choices=tuple(DTYPE_BYTES), help=f"policy dtype (default {d.dtype})")
    parser.add_argument("--attention", choices=ATTENTIONS, help=f"core attention (default {d.attention})")
    parser.add_argument("--recompute", choices=RECOMPUTES, help=f"activation recompute (default {d.recompute})")
    parser.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--engine-tp", type=int, help="vLLM engine TP (default: the training TP)")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        help=f"vLLM's share of the GPU (default {d.gpu_memory_utilization:g})")
    parser.add_argument("--sleep-level", type=int, choices=(0, 1, 2), help=f"default {d.sleep_level}")
    parser.add_argument("--drafter", action=argparse.BooleanOptionalAction, default=None,
                        help="count the EAGLE drafter (default: on; with --config, when it speculates or trains)")
    parser.add_argument("--drafter-bytes-per-param", type=float, help=f"default {d.drafter_bytes_per_param:g}")
    parser.add_argument("--drafter-buffer-tokens", type=int, help=f"default {d.drafter_buffer_tokens}")
    parser.add_argument("--drafter-pack-tokens", type=int, help=f"default {d.drafter_pack_tokens}")
    parser.add_argument("--overhead-gib", type=float, help=f"CUDA context + NCCL + slack (default {d.overhead_gib:g})")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (with --config)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tlt plan", description=DESCRIPTION)
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``tlt plan``: 0 with the plan on stdout; 2 with one ``tlt plan: error: ...`` line on stderr."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Plan for parsed ``tlt plan`` arguments; 0 when the layout fits, 2 with the reason when refused."""
    from megatron_tlt.config import ConfigError  # omegaconf: only when a plan is made

    try:
        if args.config:
            plan, note = plan_from_config(args)
            print(render(plan, note=note))  # a refused plan too: its table shows where the memory goes
            require_fit(plan)
        elif args.overrides:
            raise PlanError(f"key=value overrides need --config (got {' '.join(args.overrides)})")
        elif not args.model:
            raise PlanError("give the model: --config NAME|PATH (its model.hf_dir) or --model")
        else:
            _plan_from_flags(args)
    except (PlanError, ModelConfigError, ConfigError) as err:
        sys.stdout.flush()
        print(f"tlt plan: error: {err}", file=sys.stderr)
        return 2
    return 0


def _given(args: argparse.Namespace, names: Sequence[str]) -> dict:
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _plan_from_flags(args: argparse.Namespace) -> None:
    arch, name = resolve_model(args.model)
    options = PlanOptions(**_given(args, [*CONFIG_KEYS.keys() - {"tp", "pp"}, *DIRECT_OPTIONS]))
    if args.tp and args.pp:
        plan = plan_layout(arch, nodes=args.nodes, gpus_per_node=args.gpus_per_node, tp=args.tp, pp=args.pp,
                           options=options, model_name=name)
        print(render(plan))
        require_fit(plan)
    else:
        plan, alternatives = search_layouts(arch, nodes=args.nodes, gpus_per_node=args.gpus_per_node, tp=args.tp,
                                            pp=args.pp, options=options, model_name=name)
        print(render(plan, alternatives, chosen_by_search=True))


def plan_from_config(args: argparse.Namespace) -> tuple[LayoutPlan, str | None]:
    """The plan of the config ``tlt train --config ... key=value ...`` would run, on the given cluster
    (flags naming a config key override it); returns it with a note on where the model came from."""
    from megatron_tlt.config import load_config

    world = args.nodes * args.gpus_per_node
    overrides = [f"{CONFIG_KEYS[name]}={_yaml(value)}" for name, value in _given(args, CONFIG_KEYS).items()]
    if (args.tp or args.pp) and not any(o.startswith("parallel.data_parallel_size=") for o in args.overrides):
        preview = load_config(args.config, list(args.overrides) + overrides).parallel  # DP follows a TP/PP flag
        model_parallel = preview.tensor_parallel_size * preview.pipeline_parallel_size
        if world % model_parallel == 0:
            overrides.append(f"parallel.data_parallel_size={world // model_parallel}")
    config = load_config(args.config, list(args.overrides) + overrides)
    p = config.parallel
    needed = p.tensor_parallel_size * p.pipeline_parallel_size * p.data_parallel_size
    if needed != world:  # tlt train under torchrun refuses the same (rl/run.py)
        raise PlanError(f"{cluster_name(args.nodes, args.gpus_per_node)} start {world} ranks but the config needs "
                        f"tensor x pipeline x data parallel = {needed}; set parallel.data_parallel_size to match")
    if args.model:
        (arch, name), note = resolve_model(args.model), None
    elif config.model.hf_dir is None:
        raise PlanError("the config's model.hf_dir is None (the tiny default, whose vocabulary a tokenizer trained "
                        "at run time decides): set model.hf_dir or pass --model")
    else:
        arch, name, note = resolve_hf_dir(config.model.hf_dir)
    d = config.drafter
    options = PlanOptions(
        micro_batch_size=config.trainer.micro_batch_size,
        seq_len=config.data.max_prompt_tokens + config.rollout.max_response_tokens,
        dtype=config.model.dtype, attention=config.model.attention, recompute=config.trainer.recompute,
        sequence_parallel=p.sequence_parallel, distributed_optimizer=config.optimizer.distributed,
        engine_tp=config.rollout.engine.tensor_parallel_size,
        gpu_memory_utilization=config.rollout.engine.gpu_memory_utilization,
        drafter=d.depth > 0 or d.spot_training, drafter_buffer_tokens=d.buffer_tokens,
        drafter_pack_tokens=d.pack_tokens)
    options = dataclasses.replace(options, **_given(args, DIRECT_OPTIONS))
    plan = plan_layout(arch, nodes=args.nodes, gpus_per_node=args.gpus_per_node, tp=p.tensor_parallel_size,
                       pp=p.pipeline_parallel_size, options=options, model_name=name)
    return plan, note


def _yaml(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


# ----------------------------------------------------------------------------- output


def render(plan: LayoutPlan, alternatives: Sequence[LayoutPlan] | None = None, *, chosen_by_search: bool = False,
           note: str | None = None) -> str:
    """The plan as ``tlt plan`` prints it: model, cluster, layout, the memory table, the verdict, the phases."""
    o, arch = plan.options, plan.arch
    chosen = "  (chosen: the smallest TP x PP that fits, ties to the smaller PP)" if chosen_by_search else ""
    stage_params = ", ".join(f"{n / 1e9:.2f}B" for n in _stage_summary(plan.stage_params))
    table_title = f"{plan.stage} pipeline stage (the worst)" if plan.pp > 1 else "one pipeline stage"
    lines = [
        (f"model: {plan.model_name} ({arch.architecture}, {count_parameters(arch) / 1e9:.2f}B parameters, "
         f"{arch.num_layers} layers, {arch.num_attention_heads} heads / {arch.num_kv_heads} KV heads)"),
        *([f"  {note}"] if note else []),
        f"cluster: {cluster_name(plan.nodes, plan.gpus_per_node)} = {plan.world_size} GPUs of {o.gpu_memory_gib:g} GiB",
        f"layout: TP={plan.tp} PP={plan.pp} DP={plan.dp}{chosen}",
        (f"  pipeline stages: {plan.pp}, {plan.layers_per_stage} layers per stage; parameters per GPU "
         f"(first, ..., last stage): {stage_params}"),
        (f"  vLLM engines: TP={plan.engine_tp}, {plan.engines_per_node} per node, "
         f"{plan.world_size // plan.engine_tp} in all; KV cache for {plan.kv_cache_tokens:,} tokens per engine"),
        (f"  training: micro-batch {o.micro_batch_size} x {o.seq_len} tokens, {o.dtype}, attention={o.attention}, "
         f"recompute={o.recompute}, sequence parallel {'on' if o.sequence_parallel else 'off'}, "
         f"distributed optimizer {'on' if o.distributed_optimizer else 'off'}"),
        "",
        f"memory per GPU (GiB), {table_title}:",
    ]
    width = max(len(p.label) for p in plan.parts) + 2
    lines.append(f"  {'part':<{width}}{'training':>9}{'rollout':>9}{'sync':>9}   source")
    for p in plan.parts:
        cells = "".join(f"{p.gib[ph]:>9.1f}" if p.gib[ph] else f"{'-':>9}" for ph in PHASES)
        lines.append(f"  {p.label:<{width}}{cells}   {p.source}")
    lines.append(f"  {'total':<{width}}" + "".join(f"{plan.phase_gib(ph):>9.1f}" for ph in PHASES))
    verdict = "fits" if plan.fits_memory else "DOES NOT FIT"
    lines.append(f"peak: {plan.peak_gib:.1f} GiB ({plan.peak_phase} phase) of {o.gpu_memory_gib:g} GiB: {verdict} "
                 f"({o.gpu_memory_gib - plan.peak_gib:+.1f} GiB headroom)")
    if plan.engine_problem:
        lines.append(f"rollout engine: {plan.engine_problem}")
    lines += ["", *_phases(plan)]
    if alternatives is not None:
        lines.append("")
        if alternatives:
            lines.append("other layouts that fit:")
            lines += [f"  {a.summary()}: peak {a.peak_gib:.1f} GiB ({a.peak_phase})" for a in alternatives]
        else:
            lines.append("no other layout fits")
    return "\n".join(lines)


def _phases(plan: LayoutPlan) -> list[str]:
    o = plan.options
    if o.sleep_level == 0:
        vllm_in_training = "stays awake (sleep level 0): its whole budget stays taken"
    else:
        kept = "a copy of its weights kept in host RAM" if o.sleep_level == 1 else "its weights discarded"
        vllm_in_training = f"sleeps at level {o.sleep_level}: weights and KV cache leave the GPU ({kept})"
    drafter = ", the drafter (state, head copies, feature buffer)" if o.drafter else ""
    return [
        "how the phases share the GPU (colocated; peak = the largest phase total):",
        f"  resident in every phase: Megatron's weights, grads and optimizer state{drafter}, CUDA/NCCL overhead",
        f"  training (log-prob + update): activations on top; vLLM {vllm_in_training}",
        (f"  rollout: vLLM awake in its {o.gpu_memory_utilization:g} x GPU budget"
         + ("; idle ranks train the drafter" if o.drafter else "")),
        "  sync: vLLM woken; its weights and Megatron's on the GPU together while buckets stream",
        f"  host RAM per node for vLLM's weights while it sleeps: {plan.host_gib_per_node:.0f} GiB",
    ]


def _stage_summary(stage_params: list[int]) -> list[int]:
    if len(stage_params) <= 2:
        return stage_params
    return [stage_params[0], stage_params[1], stage_params[-1]]
