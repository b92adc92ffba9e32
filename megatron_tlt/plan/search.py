"""``tlt plan``: choose a TP/PP/DP layout for a model on a cluster and estimate memory per GPU.

The planner checks a layout the way Megatron-Core, vLLM and ``tlt train`` would refuse it, with the rules
and words of ``tlt train``'s rule book (``layout_rules``: TP divides the attention and KV heads and the
MLP, PP the layers, the engine's TP the policy's; sequence parallelism needs TP > 1) and the cluster's
own (``plan_checks``: TP x PP divides the GPUs, TP stays inside a node), then estimates the memory of one
GPU in the three phases of a colocated RL step and refuses a layout whose peak exceeds the GPU. The command line and the config keys are ``plan/cli.py``'s; the
formulas are ``plan/memory.py``'s; the model and its parameter counts ``plan/model.py``'s.

How the phases share a GPU, as ``rl/trainer.py`` runs them (colocated, ``../shared/DESIGN.md`` section 1):

* **resident in every phase**: Megatron's weights, gradients (fp32 main-grad buffer) and optimizer
  state (the trainer does not offload them), the CUDA context and NCCL buffers, and the drafter (its
  weights, gradients and Adam state, its copies of the policy's embedding and LM head, its feature buffer).
* **training phase** (log-prob pass, update): Megatron's activations on top; the vLLM engine sleeps
  (level 1, before the log-prob pass). vLLM's sleep mode (``LLM.sleep``) frees the engine's weights *and*
  KV cache from GPU memory at both levels: level 1 keeps a copy of the weights in host RAM, level 2
  discards them [vLLM docs, "Sleep Mode"]. ``sleep_level=0`` models an engine that never sleeps.
* **rollout phase**: the engine is awake and takes ``gpu_memory_utilization`` of the GPU (weights
  included; the rest of that budget is KV cache); the EAGLE drafter trains on ranks idle in the rollout
  long tail, so its working set counts here.
* **weight sync** (the engine is woken before it): Megatron's weights and the engine's weights are both
  on the GPU while buckets stream from one to the other.

The peak is the largest phase total; the table prints every part in every phase. Numbers are estimates:
allocator fragmentation is not modelled, and vLLM's own activation peak and CUDA graphs come out of its
KV-cache budget.
"""

from __future__ import annotations

import dataclasses

from megatron_tlt import layout_rules
from megatron_tlt.formats.architecture import PolicyArchitecture
from megatron_tlt.model.build_options import ATTENTIONS, RECOMPUTES
from megatron_tlt.plan.checks import (
    check_engine_tp,
    check_layout,
    check_pipeline_parallel,
    check_tensor_parallel,
    cluster_name,
    valid_layouts,
)
from megatron_tlt.plan.memory import (
    BF16,
    DTYPE_BYTES,
    FP32,
    ActivationSetting,
    StageActivations,
    kv_cache_bytes_per_token,
    model_state_bytes_per_param,
    stage_activations,
)
from megatron_tlt.plan.model import PlanError, drafter_parameters, stage_parameters

GIB = 1024**3


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """Everything about the job except the layout. How the policy is built defaults to what ``tlt train``
    builds by default (``config.py``); ``plan_cli`` fills them from a config's keys."""

    gpu_memory_gib: float = 80.0
    """Memory of one GPU (H100 SXM: 80)."""
    micro_batch_size: int = 1
    """``trainer.micro_batch_size``."""
    seq_len: int = 8192
    """Prompt + response tokens of one training sequence (``data.max_prompt_tokens + rollout.max_response_tokens``)."""
    dtype: str = "bfloat16"
    """``model.dtype``: the policy's parameters and activations (``tlt train``'s CPU default is float32; a
    GPU run sets bfloat16, as the flagship config does)."""
    attention: str = "sdpa"
    """``model.attention``: sdpa, local or te (assumed to keep what SDPA keeps; not measured here)."""
    recompute: str = "none"
    """``trainer.recompute``: none, selective (core attention) or full (each layer keeps its input)."""
    sequence_parallel: bool = False
    """``parallel.sequence_parallel`` (needs TP > 1)."""
    distributed_optimizer: bool = False
    """``optimizer.distributed``: the fp32 master weights and Adam moments sharded over DP."""
    engine_tp: int | None = None
    """Tensor-parallel size of each vLLM engine (default: the training TP)."""
    gpu_memory_utilization: float = 0.4
    """vLLM's share of the GPU, weights included (``rollout.engine.gpu_memory_utilization``)."""
    sleep_level: int = 1
    """vLLM sleep level during training: 1 (what the trainer does) or 2 free its GPU memory, 0 = never sleeps."""
    drafter: bool = True
    drafter_bytes_per_param: float = 8.0
    """What ``megatron_tlt/drafter/trainer.py`` does on GPU: torch AdamW on bf16 parameters, so bf16 weights,
    grads and both moments (2 + 2 + 2 + 2). 16 with fp32 master weights and moments."""
    drafter_buffer_tokens: int = 65536
    """``drafter.buffer_tokens``: bf16 post-norm features kept on the GPU."""
    drafter_pack_tokens: int = 1024
    """``drafter.pack_tokens``: rows per drafter micro-step (its working set)."""
    sync_bucket_bytes: int = 256 * 1024 * 1024
    """``rl/weight_sync.py``'s bucket size (a bucket holds at least its largest tensor)."""
    overhead_gib: float = 3.0
    """CUDA context, NCCL communicators and buffers, allocator slack: a stated constant, not measured."""


PHASES = ("training", "rollout", "sync")



@dataclasses.dataclass(frozen=True)
class MemoryPart:
    """One row of the plan's table: what takes memory, in each phase, and where the figure comes from."""

    key: str
    label: str
    gib: dict[str, float]
    """GiB in each phase (``PHASES``)."""
    source: str


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
    """A checked layout with its per-GPU memory in each phase (``plan_layout``); ``fits`` says whether it runs."""

    model_name: str
    arch: PolicyArchitecture
    options: PlanOptions
    nodes: int
    gpus_per_node: int
    tp: int
    pp: int
    dp: int
    engine_tp: int
    stage: str
    """The worst pipeline stage, whose memory the parts describe: first, last, or only."""
    stage_params: list[int]
    parts: list[MemoryPart]
    kv_cache_tokens: int
    host_gib_per_node: float
    engine_problem: str | None = None
    """Why the rollout engine cannot serve in its budget (no room for a KV cache of one sequence), if so."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def layers_per_stage(self) -> int:
        return self.arch.num_layers // self.pp

    @property
    def engines_per_node(self) -> int:
        return self.gpus_per_node // self.engine_tp

    def phase_gib(self, phase: str) -> float:
        return sum(p.gib[phase] for p in self.parts)

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.phase_gib)

    @property
    def peak_gib(self) -> float:
        return self.phase_gib(self.peak_phase)

    @property
    def fits_memory(self) -> bool:
        return self.peak_gib <= self.options.gpu_memory_gib

    @property
    def fits(self) -> bool:
        return self.fits_memory and self.engine_problem is None

    @property
    def biggest_part(self) -> MemoryPart:
        phase = self.peak_phase
        return max(self.parts, key=lambda p: p.gib[phase])

    def summary(self) -> str:
        return f"TP={self.tp} PP={self.pp} DP={self.dp}"


# ----------------------------------------------------------------------------- the estimate


def _check_options(o: PlanOptions, *, tp: int) -> None:
    if o.micro_batch_size < 1 or o.seq_len < 1:
        raise PlanError(f"micro-batch size and sequence length must be >= 1, got {o.micro_batch_size} and {o.seq_len}")
    if not 0 < o.gpu_memory_utilization <= 1:
        raise PlanError(f"gpu_memory_utilization must be in (0, 1], got {o.gpu_memory_utilization}")
    if o.sleep_level not in (0, 1, 2):
        raise PlanError(f"sleep level must be 0, 1 or 2, got {o.sleep_level}")
    if o.dtype not in DTYPE_BYTES:
        raise PlanError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got '{o.dtype}'")
    if o.attention not in ATTENTIONS:
        raise PlanError(f"attention must be one of {', '.join(ATTENTIONS)}, got '{o.attention}'")
    if o.recompute not in RECOMPUTES:
        raise PlanError(f"recompute must be one of {', '.join(RECOMPUTES)}, got '{o.recompute}'")
    try:
        layout_rules.check_sequence_parallel(sequence_parallel=o.sequence_parallel, tp=tp)
    except layout_rules.LayoutError as err:
        raise PlanError(f"TP={tp} refused: {err}") from None


def plan_layout(arch: PolicyArchitecture, *, nodes: int, gpus_per_node: int, tp: int, pp: int,
                options: PlanOptions = PlanOptions(), model_name: str = "model") -> LayoutPlan:
    """Check a layout and estimate its memory per GPU (worst pipeline stage). Raises ``PlanError`` for a
    layout that cannot run; a valid layout that is too big, or whose rollout engine has no room for the KV
    cache of one sequence, is returned with ``fits`` False (``require_fit`` refuses it, saying why)."""
    o = options
    engine_tp = o.engine_tp or tp
    dp = check_layout(arch, nodes=nodes, gpus_per_node=gpus_per_node, tp=tp, pp=pp, engine_tp=engine_tp)
    _check_options(o, tp=tp)
    h, s = arch.hidden_size, o.seq_len
    gpu_bytes = o.gpu_memory_gib * GIB
    stage_params = stage_parameters(arch, tp, pp)

    # vLLM engine: bf16 weights split by the engine's TP (the EAGLE head too, its fc replicated), and the
    # KV cache = what is left of its gpu_memory_utilization budget.
    engine_params = sum(stage_parameters(arch, engine_tp, 1))
    if o.drafter:
        engine_params += (drafter_parameters(arch) - 2 * h * h) // engine_tp + 2 * h * h
    engine_weights = BF16 * engine_params
    engine_budget = o.gpu_memory_utilization * gpu_bytes
    kv_bytes = max(0.0, engine_budget - engine_weights)
    kv_tokens = int(kv_bytes // kv_cache_bytes_per_token(arch, engine_tp, extra_layers=int(o.drafter)))
    engine_problem = None
    if engine_weights >= engine_budget:
        engine_problem = (
            f"engine TP={engine_tp}: the vLLM engine's bf16 weights ({engine_weights / GIB:.1f} GiB per GPU) exceed "
            f"its gpu_memory_utilization budget ({o.gpu_memory_utilization:g} x {o.gpu_memory_gib:g} GiB = "
            f"{engine_budget / GIB:.1f} GiB), leaving no KV cache: raise --gpu-memory-utilization or the engine TP")
    elif kv_tokens < s:
        engine_problem = (
            f"engine TP={engine_tp}: the vLLM KV cache ({kv_bytes / GIB:.1f} GiB) holds {kv_tokens} tokens, fewer "
            f"than one {s}-token sequence: raise --gpu-memory-utilization or the engine TP")

    setting = ActivationSetting(seq_len=s, micro_batch_size=o.micro_batch_size, tensor_parallel_size=tp,
                                sequence_parallel=o.sequence_parallel, attention=o.attention, recompute=o.recompute,
                                param_bytes=DTYPE_BYTES[o.dtype])
    param_bytes = DTYPE_BYTES[o.dtype]
    state_per_param = model_state_bytes_per_param(param_bytes=param_bytes, data_parallel_size=dp,
                                                  distributed_optimizer=o.distributed_optimizer)
    engine = {"engine_tp": engine_tp, "weights": engine_weights, "kv": kv_bytes}

    # The two stages that can be the worst: the first holds the embedding and, under 1F1B, PP micro-batches
    # in flight (PP x L/PP = L layers' activations); the last holds the LM head, the loss and one.
    stages = {"first": (0, pp), "last": (pp - 1, 1)} if pp > 1 else {"only": (0, 1)}
    candidates = []
    for stage_name, (index, in_flight) in stages.items():
        activations = stage_activations(arch, setting, num_layers=arch.num_layers // pp, in_flight=in_flight,
                                        first_stage=index == 0, last_stage=index == pp - 1,
                                        padded_vocab_size=arch.padded_vocab_size(tp))
        parts = _parts(arch, o, params=stage_params[index], state_per_param=state_per_param, dp=dp,
                       layers=arch.num_layers // pp, in_flight=in_flight, activations=activations,
                       padded_vocab=arch.padded_vocab_size(tp), engine=engine)
        candidates.append((stage_name, parts))
    stage_name, parts = max(candidates, key=lambda c: max(sum(p.gib[ph] for p in c[1]) for ph in PHASES))
    host = engine_weights if o.sleep_level == 1 else 0.0
    return LayoutPlan(model_name=model_name, arch=arch, options=o, nodes=nodes, gpus_per_node=gpus_per_node,
                      tp=tp, pp=pp, dp=dp, engine_tp=engine_tp, stage=stage_name, stage_params=stage_params,
                      parts=parts, kv_cache_tokens=kv_tokens, host_gib_per_node=host * gpus_per_node / GIB,
                      engine_problem=engine_problem)


def _part(key: str, label: str, training: float, rollout: float, sync: float, source: str) -> MemoryPart:
    return MemoryPart(key, label, {"training": training / GIB, "rollout": rollout / GIB, "sync": sync / GIB}, source)


def _parts(arch: PolicyArchitecture, o: PlanOptions, *, params: int, state_per_param: float, dp: int, layers: int,
           in_flight: int, activations: StageActivations, padded_vocab: int, engine: dict) -> list[MemoryPart]:
    h, param_bytes = arch.hidden_size, DTYPE_BYTES[o.dtype]
    weights_b, grads_b = param_bytes * params, FP32 * params
    optimizer_per_param = state_per_param - param_bytes - FP32
    optim_b = optimizer_per_param * params
    shard = f"/ DP={dp}" if o.distributed_optimizer else "(not sharded)"
    master = "fp32 master + " if param_bytes != FP32 else ""
    sp = "sequence parallel, " if o.sequence_parallel else ""
    parts = [
        _part("weights", f"policy weights ({o.dtype})", weights_b, weights_b, weights_b, f"{param_bytes} B/param"),
        _part("grads", "policy grads (fp32 main grad)", grads_b, grads_b, grads_b, "4 B/param, Megatron DDP buffer"),
        _part("optimizer", f"optimizer ({master}Adam m, v)", optim_b, optim_b, optim_b,
              f"{optimizer_per_param * (dp if o.distributed_optimizer else 1):g} B/param {shard}, "
              "Megatron dist_optimizer.md"),
        _part("activations", f"activations kept ({layers} layers x {in_flight} in flight)", activations.kept_bytes,
              0, 0, f"{o.attention}, {sp}recompute {o.recompute}: plan/memory.py"),
        _part("working", "working set at the peak", activations.working_bytes, 0, 0, activations.moment),
    ]
    sleeping = 0.0 if o.sleep_level else 1.0
    sync_buffer = 2 * max(o.sync_bucket_bytes, BF16 * max(padded_vocab * h, 2 * arch.intermediate_size * h))
    parts += [
        _part("engine_weights", f"vLLM weights (bf16, engine TP={engine['engine_tp']})", sleeping * engine["weights"],
              engine["weights"], engine["weights"], "sleep frees them in training"),
        _part("kv_cache", "vLLM KV cache", sleeping * engine["kv"], engine["kv"], 0,
              f"{o.gpu_memory_utilization:g} x GPU - vLLM weights"),
        _part("sync_buffer", "weight-sync buckets", 0, 0, sync_buffer, "gathered bucket + HF copy"),
    ]
    if o.drafter:
        parts += _drafter_parts(arch, o)
    overhead = o.overhead_gib * GIB
    parts.append(_part("overhead", "CUDA context + NCCL + allocator", overhead, overhead, overhead,
                       f"stated constant {o.overhead_gib:g} GiB"))
    return parts


def _drafter_parts(arch: PolicyArchitecture, o: PlanOptions) -> list[MemoryPart]:
    h = arch.hidden_size
    n = drafter_parameters(arch)
    state = o.drafter_bytes_per_param * n
    heads = BF16 * arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2)
    features = BF16 * o.drafter_buffer_tokens * h
    t = o.drafter_pack_tokens
    # The drafter is a plain module (drafter/model.py), not the policy's layer: one layer's activations on a
    # pack (Korthikanti et al. 2022's 34 + 5as/h bytes per token and hidden unit, b=1, t=1) plus ~5 fp32
    # vocabulary-sized rows per token in the loss (target logits and probs, drafter logits and
    # log-softmax, their product: megatron_tlt/drafter/loss.py)
    working = t * h * (34 + 5 * arch.num_attention_heads * t / h) + 5 * FP32 * t * arch.vocab_size
    return [
        _part("drafter_state", "EAGLE drafter (weights, grads, Adam)", state, state, state,
              f"{n / 1e9:.2f}B params x {o.drafter_bytes_per_param:g} B"),
        _part("drafter_heads", "drafter's embedding + LM head copy", heads, heads, heads, "bf16, drafter/trainer.py"),
        _part("drafter_buffer", f"drafter feature buffer ({o.drafter_buffer_tokens} tokens)", features, features,
              features, "bf16 x hidden"),
        # The log-prob pass captures (last stage) or receives (other stages) at most a buffer's worth of
        # new features, held beside the buffer until it has copied them in: rl/actor.py. Counted at the
        # training peak although the pass ends before the backward, so an upper bound.
        _part("drafter_features", "new features of the log-prob pass", features, 0, 0, "<= buffer, until buffered"),
        _part("drafter_work", "drafter training step (spot)", 0, working, 0, f"{t}-token pack, idle ranks"),
    ]


_ADVICE = {
    "weights": "raise TP or PP to split the model over more GPUs",
    "grads": "raise TP or PP to split the model over more GPUs",
    "optimizer": "raise TP or PP, or shard it over DP with optimizer.distributed=true (--distributed-optimizer)",
    "activations": ("use trainer.recompute=full (--recompute full), turn on parallel.sequence_parallel with TP > 1, "
                    "or lower the micro-batch or sequence length; under 1F1B the first stage keeps L layers' "
                    "worth whatever the PP"),
    "working": ("lower the micro-batch or sequence length, raise TP (with sequence parallelism), or use "
                "model.attention=sdpa where it is local"),
    "engine_weights": "lower --gpu-memory-utilization or raise the engine TP",
    "kv_cache": "lower --gpu-memory-utilization",
    "sync_buffer": "lower the weight-sync bucket size",
    "drafter_state": "lower --drafter-bytes-per-param (bf16 Adam moments: 8) or turn the drafter off (--no-drafter)",
    "drafter_heads": "turn the drafter off (--no-drafter)",
    "drafter_buffer": "lower drafter.buffer_tokens",
    "drafter_features": "lower drafter.buffer_tokens",
    "drafter_work": "lower drafter.pack_tokens",
    "overhead": "use a GPU with more memory",
}


def refusal(plan: LayoutPlan) -> str:
    """The one-sentence reason a plan that does not fit is refused (memory first, then the engine's KV cache)."""
    if plan.fits_memory and plan.engine_problem:
        return f"{plan.summary()} refused: {plan.engine_problem}"
    part, phase = plan.biggest_part, plan.peak_phase
    stage = f" ({plan.stage} pipeline stage)" if plan.pp > 1 else ""
    return (f"{plan.summary()} needs {plan.peak_gib:.1f} GiB per GPU in the {phase} phase{stage}, more than the "
            f"{plan.options.gpu_memory_gib:g} GiB GPU; the biggest part is {part.label} at {part.gib[phase]:.1f} GiB: "
            f"{_ADVICE[part.key]}")


def require_fit(plan: LayoutPlan) -> LayoutPlan:
    if not plan.fits:
        raise PlanError(refusal(plan))
    return plan


def search_layouts(arch: PolicyArchitecture, *, nodes: int, gpus_per_node: int, tp: int | None = None,
                   pp: int | None = None, options: PlanOptions = PlanOptions(),
                   model_name: str = "model") -> tuple[LayoutPlan, list[LayoutPlan]]:
    """The layout to use and the other layouts that also fit.

    Enumerates the valid (TP, PP) (``tp``/``pp`` fix one of them), keeps those that fit, and chooses the
    smallest TP x PP (the most data parallelism), ties going to the smaller PP (fewer pipeline bubbles).
    Raises ``PlanError`` when none is valid or none fits, naming the closest one.
    """
    layouts = valid_layouts(arch, nodes=nodes, gpus_per_node=gpus_per_node, tp=tp, pp=pp, engine_tp=options.engine_tp)
    if not layouts:
        # let a fixed value's own reason speak
        if tp:
            check_tensor_parallel(arch, tp=tp, gpus_per_node=gpus_per_node)
        if pp:
            check_pipeline_parallel(arch, pp=pp)
        if options.engine_tp:
            check_engine_tp(arch, engine_tp=options.engine_tp, gpus_per_node=gpus_per_node, policy_tp=tp)
        fixed = " with " + " ".join(f"{k}={v}" for k, v in (("TP", tp), ("PP", pp)) if v) if (tp or pp) else ""
        raise PlanError(f"no valid layout{fixed} for {cluster_name(nodes, gpus_per_node)}: TP must divide the heads, "
                        f"intermediate_size and the GPUs of a node, PP the {arch.num_layers} layers, TP x PP the "
                        "GPUs, and the engine TP the TP")
    plans, errors = [], []
    for t, p in layouts:
        try:
            plans.append(plan_layout(arch, nodes=nodes, gpus_per_node=gpus_per_node, tp=t, pp=p, options=options,
                                     model_name=model_name))
        except PlanError as err:
            errors.append(str(err))
    fitting = sorted((pl for pl in plans if pl.fits), key=lambda pl: (pl.tp * pl.pp, pl.pp))
    if not fitting:
        if not plans:
            raise PlanError(errors[0])
        closest = min(plans, key=lambda pl: pl.peak_gib)
        raise PlanError(f"no layout of {nodes * gpus_per_node} GPUs fits in {options.gpu_memory_gib:g} GiB; the "
                        f"closest: {refusal(closest)}")
    return fitting[0], fitting[1:]
