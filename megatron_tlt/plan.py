"""``tlt plan``: choose a TP/PP/DP layout for a model on a cluster and estimate memory per GPU.

The planner checks a layout the way Megatron-Core and vLLM would refuse it (TP must divide the attention
and KV heads, PP the layers, TP x PP the GPUs; TP stays inside a node), then estimates the memory of
one GPU in the two phases of a colocated RL step and refuses a layout whose peak exceeds the GPU.

How the phases share a GPU (colocated mode, the design of ``../shared/DESIGN.md`` section 1):

* **training phase** (log-prob pass, update): Megatron's weights, gradients, optimizer state and
  activations are on the GPU; the vLLM engine sleeps. vLLM's sleep mode (``LLM.sleep``) frees the
  engine's weights *and* KV cache from GPU memory at both levels: level 1 keeps a copy of the
  weights in host RAM, level 2 discards them (they are resent by the next weight sync)
  [vLLM docs, "Sleep Mode"]. ``sleep_level=0`` models an engine that never sleeps: its whole
  budget stays taken.
* **rollout phase**: the engine is awake and takes ``gpu_memory_utilization`` of the GPU (weights
  included; the rest of that budget is KV cache) while Megatron's training state is offloaded to
  host RAM (``offload_training_state``, as colocated RL trainers such as VeRL do); the EAGLE drafter
  trains on ranks idle in the rollout long tail, so its working set counts here.
* **weight sync** (short, between the two): Megatron's bf16 weights and the engine's weights are both
  on the GPU while buckets stream from one to the other.
* **resident in every phase**: the CUDA context and NCCL buffers, and the drafter (its weights,
  gradients and Adam state, its copies of the policy's embedding and LM head, its feature buffer).

The peak is the largest phase total; the table prints every part in every phase.

Numbers are estimates: the activation formula is the GPT one of Korthikanti et al. (Llama's SwiGLU
MLP, GQA and the absence of dropout move it by a few ``sbh`` per layer), allocator fragmentation is
not modelled, and vLLM's own activation peak and CUDA graphs come out of its KV-cache budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from megatron_tlt.model_config import ModelConfigError, PolicyArchitecture, architecture_from_dict, load_architecture

GIB = 1024**3
MODELS_DIR = Path(__file__).resolve().parents[1] / "launch" / "models"
RECOMPUTE_CHOICES = ("none", "selective", "full")

# Bytes per parameter of Megatron's mixed-precision Adam (bf16 parameters, fp32 gradients).
BF16 = 2
FP32 = 4


class PlanError(ValueError):
    """A layout that cannot run, or does not fit; the message says why in one sentence."""


# ----------------------------------------------------------------------------- the model


def resolve_model(model: str | Path) -> tuple[PolicyArchitecture, str]:
    """The architecture and a display name from an HF model directory, a config.json (any JSON file holding
    an HF config), or the name of a directory under ``launch/models`` (e.g. ``llama-3.3-70b``)."""
    path = Path(model)
    if not path.exists() and (MODELS_DIR / str(model)).is_dir():
        path = MODELS_DIR / str(model)
    try:
        if path.is_file():
            try:
                raw = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as err:
                raise ModelConfigError(f"{path}: not a readable JSON config ({err})") from None
            if not isinstance(raw, dict):
                raise ModelConfigError(f"{path}: not an HF config (a JSON object)")
            arch = architecture_from_dict(raw, source=str(path))
            name = path.resolve().parent.name if path.name == "config.json" else path.stem
        else:
            arch = load_architecture(path)
            name = path.resolve().name
    except ModelConfigError as err:
        known = sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").is_file()) if MODELS_DIR.is_dir() else []
        hint = f" (shipped configs: {', '.join(known)})" if known else ""
        raise PlanError(f"{err}{hint}") from None
    return arch, name


def _layer_parameters(arch: PolicyArchitecture, *, input_norm: bool = True) -> int:
    """Parameters of one decoder layer (unsharded)."""
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_kv_heads * d
    attention = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if arch.qkv_bias else 0)
    mlp = 3 * h * arch.intermediate_size
    return attention + mlp + h * (2 if input_norm else 1)


def count_parameters(arch: PolicyArchitecture) -> int:
    """Parameters of the HF model (unpadded vocabulary; a tied LM head counted once)."""
    embedding = arch.vocab_size * arch.hidden_size
    heads = embedding * (1 if arch.tie_word_embeddings else 2)
    return heads + arch.num_layers * _layer_parameters(arch) + arch.hidden_size


def stage_parameters(arch: PolicyArchitecture, tensor_parallel_size: int, pipeline_parallel_size: int) -> list[int]:
    """Parameters one GPU holds in each pipeline stage, from Megatron's own tensor names, shapes and TP
    splits (``megatron_tlt.weights``): TP-split tensors divided by TP, norms replicated, the padded
    vocabulary's embedding on the first stage and the LM head on the last (with tied embeddings and
    PP > 1, Megatron keeps a copy of the embedding there as the output layer)."""
    from megatron_tlt import weights  # imports torch: only when a plan is made

    tp, pp = tensor_parallel_size, pipeline_parallel_size
    padded_vocab = arch.padded_vocab_size(tp)
    per_stage = [0] * pp
    for name in weights.megatron_names(arch):
        shape = weights.megatron_full_shape(arch, name, padded_vocab)
        numel = math.prod(shape)
        split = weights.tp_split(name)
        if split is not weights.TPSplit.REPLICATED:
            numel //= tp
        per_stage[weights.owning_stage(arch, name, pp)] += numel
    if arch.tie_word_embeddings and pp > 1:
        per_stage[-1] += padded_vocab * arch.hidden_size // tp
    return per_stage


def drafter_parameters(arch: PolicyArchitecture) -> int:
    """The EAGLE drafter: one decoder layer without its first input norm, plus ``fc`` [h, 2h]; it uses the
    policy's embedding and LM head (``megatron_tlt/drafter/model.py``)."""
    return _layer_parameters(arch, input_norm=False) + 2 * arch.hidden_size * arch.hidden_size


# ----------------------------------------------------------------------------- the formulas


def model_state_bytes_per_param(*, param_bytes: int = BF16, grad_bytes: int = FP32, data_parallel_size: int = 1,
                                distributed_optimizer: bool = True) -> float:
    """Bytes per parameter of weights + gradients + Adam state in Megatron-Core.

    Source: the table of ``docs/source/api-guide/dist_optimizer.md`` in NVIDIA/Megatron-LM (bytes per
    parameter, ``d`` = data-parallel size): fp16/bf16 params with fp16 grads 20 vs 4 + 16/d; bf16 params
    with fp32 grads 18 vs 6 + 12/d; fp32 params and grads 16 vs 8 + 8/d. The optimizer always keeps fp32
    Adam moments (4 + 4), an fp32 master copy unless the params are fp32 (4), and an fp32 main-grad copy
    unless the grads are fp32 (4); the distributed optimizer (``--use-distributed-optimizer``, ZeRO-1
    style, Rajbhandari et al. 2020) shards exactly that optimizer-owned part over DP.
    """
    optimizer_bytes = 8 + (0 if param_bytes == FP32 else 4) + (0 if grad_bytes == FP32 else 4)
    shards = data_parallel_size if distributed_optimizer else 1
    return param_bytes + grad_bytes + optimizer_bytes / shards


def model_state_bytes(num_params: float, **kwargs) -> float:
    """Bytes of weights + gradients + Adam state for ``num_params`` parameters (see
    ``model_state_bytes_per_param`` for the keyword arguments and the source)."""
    return num_params * model_state_bytes_per_param(**kwargs)


def activation_bytes_per_layer(*, seq_len: int, micro_batch_size: int, hidden_size: int, num_attention_heads: int,
                               tensor_parallel_size: int, sequence_parallel: bool, recompute: str) -> float:
    """Activation bytes one transformer layer stores for the backward pass, per GPU, for one micro-batch.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 2
    (s = seq_len, b = micro-batch, h = hidden, a = heads, t = TP; 16-bit activations):
      * TP only:                     sbh (10 + 24/t + 5as/(ht))
      * TP + sequence parallel:      sbh/t (34 + 5as/h)
      * TP + selective recompute:    sbh (10 + 24/t)
      * TP + SP + selective:         34 sbh/t
      * full recompute (Sec. 5):     2 sbh, the layer input only (divided by t with sequence parallel,
        whose layer input is sharded along the sequence).
    The ``5as/h`` term is the attention score/softmax/dropout memory that selective recompute (and
    flash attention) avoids storing.
    """
    if recompute not in RECOMPUTE_CHOICES:
        raise PlanError(f"recompute must be one of {', '.join(RECOMPUTE_CHOICES)}, got '{recompute}'")
    s, b, h, a, t = seq_len, micro_batch_size, hidden_size, num_attention_heads, tensor_parallel_size
    sp = sequence_parallel and t > 1
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    stored = 34 * s * b * h / t if sp else s * b * h * (10 + 24 / t)
    if recompute == "selective":
        return stored
    return stored + 5 * a * s * s * b / t


def logits_bytes(*, seq_len: int, micro_batch_size: int, padded_vocab_size: int, tensor_parallel_size: int) -> float:
    """The last stage's fp32 logits kept for the cross-entropy / log-prob backward: 4 sbv/t bytes
    (Korthikanti et al. 2022, Sec. 4.3, output layer and loss in 32-bit, vocabulary split over TP)."""
    return 4 * seq_len * micro_batch_size * padded_vocab_size / tensor_parallel_size


def kv_cache_bytes_per_token(arch: PolicyArchitecture, engine_tp: int, *, extra_layers: int = 0) -> float:
    """bf16 K and V of every layer on one engine GPU: 2 x layers x kv heads per GPU x head_dim x 2 bytes
    (vLLM replicates KV heads when the engine TP exceeds their number)."""
    kv_heads = max(1, arch.num_kv_heads // engine_tp)
    return 2 * (arch.num_layers + extra_layers) * kv_heads * arch.head_dim * BF16


# ----------------------------------------------------------------------------- options and results


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """Everything about the job except the layout; the defaults are the ones ``tlt plan`` prints."""

    gpu_memory_gib: float = 80.0
    """Memory of one GPU (H100 SXM: 80)."""
    micro_batch_size: int = 1
    seq_len: int = 8192
    """Prompt + response tokens of one training sequence."""
    recompute: str = "selective"
    sequence_parallel: bool = True
    """Megatron's ``--sequence-parallel`` (only meaningful with TP > 1)."""
    distributed_optimizer: bool = False
    """Megatron's ``--use-distributed-optimizer``: the fp32 master weights and Adam moments sharded over DP.
    Off by default because ``tlt train`` does not use it yet (mcore.py); on, it shows what it would save."""
    engine_tp: int | None = None
    """Tensor-parallel size of each vLLM engine (default: the training TP)."""
    gpu_memory_utilization: float = 0.4
    """vLLM's share of the GPU, weights included (``RolloutEngineConfig.gpu_memory_utilization``'s default)."""
    sleep_level: int = 1
    """vLLM sleep level during training: 1 or 2 free its GPU memory, 0 = never sleeps."""
    offload_training_state: bool = True
    """Megatron's weights, gradients and optimizer state go to host RAM while vLLM generates."""
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
    key: str
    label: str
    gib: dict[str, float]
    """GiB in each phase (``PHASES``)."""
    source: str


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
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


# ----------------------------------------------------------------------------- checks


def check_tensor_parallel(arch: PolicyArchitecture, *, tp: int, gpus_per_node: int) -> None:
    """TP must divide the heads, the KV heads and the MLP, and stay within one node."""
    if tp < 1:
        raise PlanError(f"TP={tp} refused: parallel sizes must be >= 1")
    try:
        arch.validate_layout(tensor_parallel_size=tp, pipeline_parallel_size=1)
    except ModelConfigError as err:
        raise PlanError(f"TP={tp} refused: {err}") from None
    if arch.intermediate_size % tp:
        raise PlanError(f"TP={tp} refused: tensor parallel size {tp} does not divide intermediate_size "
                        f"{arch.intermediate_size}")
    if tp > gpus_per_node:
        raise PlanError(f"TP={tp} refused: tensor parallelism must stay within one node, which has "
                        f"{gpus_per_node} GPUs")
    if gpus_per_node % tp:
        raise PlanError(f"TP={tp} refused: it does not divide the {gpus_per_node} GPUs of a node, so a TP group "
                        f"would span two nodes")


def check_pipeline_parallel(arch: PolicyArchitecture, *, pp: int) -> None:
    """PP must divide the layers."""
    if pp < 1:
        raise PlanError(f"PP={pp} refused: parallel sizes must be >= 1")
    try:
        arch.validate_layout(tensor_parallel_size=1, pipeline_parallel_size=pp)
    except ModelConfigError as err:
        raise PlanError(f"PP={pp} refused: {err}") from None


def check_engine_tp(arch: PolicyArchitecture, *, engine_tp: int, gpus_per_node: int) -> None:
    """vLLM's TP must divide the attention heads (KV heads are replicated when it exceeds them) and a node."""
    e = engine_tp
    if e < 1 or gpus_per_node % e:
        raise PlanError(f"engine TP={e} refused: it must divide the {gpus_per_node} GPUs of a node")
    if arch.num_attention_heads % e:
        raise PlanError(f"engine TP={e} refused: it does not divide num_attention_heads {arch.num_attention_heads}")
    if arch.num_kv_heads % e and e % arch.num_kv_heads:
        raise PlanError(f"engine TP={e} refused: vLLM needs it to divide, or be a multiple of, "
                        f"num_key_value_heads {arch.num_kv_heads}")


def check_layout(arch: PolicyArchitecture, *, nodes: int, gpus_per_node: int, tp: int, pp: int,
                 engine_tp: int | None = None) -> int:
    """Refuse a layout that cannot run (``PlanError``, one sentence); return the data-parallel size.

    The model's own limits come first (``PolicyArchitecture.validate_layout``: TP divides the attention and
    KV heads, PP the layers), then the cluster's (TP within a node, TP x PP dividing the GPUs)."""
    if nodes < 1 or gpus_per_node < 1:
        raise PlanError(f"nodes and GPUs per node must be >= 1, got {nodes} x {gpus_per_node}")
    check_tensor_parallel(arch, tp=tp, gpus_per_node=gpus_per_node)
    check_pipeline_parallel(arch, pp=pp)
    world = nodes * gpus_per_node
    if world % (tp * pp):
        raise PlanError(f"TP={tp} PP={pp} refused: TP x PP = {tp * pp} does not divide the {world} GPUs "
                        f"({_cluster(nodes, gpus_per_node)})")
    if engine_tp is not None:
        check_engine_tp(arch, engine_tp=engine_tp, gpus_per_node=gpus_per_node)
    return world // (tp * pp)


def _cluster(nodes: int, gpus_per_node: int) -> str:
    return f"{nodes} node{'s' if nodes != 1 else ''} x {gpus_per_node} GPUs"


# ----------------------------------------------------------------------------- the estimate


def plan_layout(arch: PolicyArchitecture, *, nodes: int, gpus_per_node: int, tp: int, pp: int,
                options: PlanOptions = PlanOptions(), model_name: str = "model") -> LayoutPlan:
    """Check a layout and estimate its memory per GPU (worst pipeline stage). Raises ``PlanError`` for a
    layout that cannot run; a valid layout that is too big, or whose rollout engine has no room for the KV
    cache of one sequence, is returned with ``fits`` False (``require_fit`` refuses it, saying why)."""
    o = options
    if o.micro_batch_size < 1 or o.seq_len < 1:
        raise PlanError(f"micro-batch size and sequence length must be >= 1, got {o.micro_batch_size} and {o.seq_len}")
    if not 0 < o.gpu_memory_utilization <= 1:
        raise PlanError(f"gpu_memory_utilization must be in (0, 1], got {o.gpu_memory_utilization}")
    if o.sleep_level not in (0, 1, 2):
        raise PlanError(f"sleep level must be 0, 1 or 2, got {o.sleep_level}")
    engine_tp = o.engine_tp or tp
    dp = check_layout(arch, nodes=nodes, gpus_per_node=gpus_per_node, tp=tp, pp=pp, engine_tp=engine_tp)
    h, s, b = arch.hidden_size, o.seq_len, o.micro_batch_size
    gpu_bytes = o.gpu_memory_gib * GIB
    padded_vocab = arch.padded_vocab_size(tp)
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

    per_layer = activation_bytes_per_layer(seq_len=s, micro_batch_size=b, hidden_size=h,
                                           num_attention_heads=arch.num_attention_heads, tensor_parallel_size=tp,
                                           sequence_parallel=o.sequence_parallel, recompute=o.recompute)
    state_per_param = model_state_bytes_per_param(data_parallel_size=dp, distributed_optimizer=o.distributed_optimizer)
    optimizer_per_param = state_per_param - BF16 - FP32

    # The two stages that can be the worst: the first holds the embedding and, under 1F1B, PP micro-batches
    # in flight (PP x L/PP = L layers' activations); the last holds the LM head, the fp32 logits and one.
    stages = {"first": (0, pp), "last": (pp - 1, 1)} if pp > 1 else {"only": (0, 1)}
    candidates = []
    for stage_name, (index, in_flight) in stages.items():
        params = stage_params[index]
        last = index == pp - 1
        parts = _parts(arch, o, params=params, optimizer_per_param=optimizer_per_param, dp=dp, tp=tp, pp=pp,
                       per_layer=per_layer, in_flight=in_flight, last=last, padded_vocab=padded_vocab,
                       engine_tp=engine_tp, engine_weights=engine_weights, kv_bytes=kv_bytes,
                       engine_budget=engine_budget)
        candidates.append((stage_name, params, parts))
    stage_name, worst_params, parts = max(
        candidates, key=lambda c: max(sum(p.gib[ph] for p in c[2]) for ph in PHASES))

    host = 0.0
    if o.offload_training_state:
        host += state_per_param * worst_params
    if o.sleep_level == 1:
        host += engine_weights
    return LayoutPlan(model_name=model_name, arch=arch, options=o, nodes=nodes, gpus_per_node=gpus_per_node,
                      tp=tp, pp=pp, dp=dp, engine_tp=engine_tp, stage=stage_name, stage_params=stage_params,
                      parts=parts, kv_cache_tokens=kv_tokens, host_gib_per_node=host * gpus_per_node / GIB,
                      engine_problem=engine_problem)


def _parts(arch, o: PlanOptions, *, params, optimizer_per_param, dp, tp, pp, per_layer, in_flight, last,
           padded_vocab, engine_tp, engine_weights, kv_bytes, engine_budget) -> list[MemoryPart]:
    h, s, b = arch.hidden_size, o.seq_len, o.micro_batch_size
    off = o.offload_training_state

    def part(key, label, training, rollout, sync, source):
        return MemoryPart(key, label, {"training": training / GIB, "rollout": rollout / GIB, "sync": sync / GIB},
                          source)

    weights_b, grads_b, optim_b = BF16 * params, FP32 * params, optimizer_per_param * params
    layers = arch.num_layers // pp
    activations = per_layer * layers * in_flight
    logits = logits_bytes(seq_len=s, micro_batch_size=b, padded_vocab_size=padded_vocab,
                          tensor_parallel_size=tp) if last else 0.0
    sleeping = 0.0 if o.sleep_level else 1.0
    shard = f"/ DP={dp}" if o.distributed_optimizer else "(not sharded)"
    parts = [
        part("weights", "policy weights (bf16)", weights_b, 0 if off else weights_b, weights_b,
             "2 B/param"),
        part("grads", "policy grads (fp32 main grad)", grads_b, 0 if off else grads_b, 0 if off else grads_b,
             "4 B/param, Megatron DDP buffer"),
        part("optimizer", "optimizer (fp32 master + Adam m, v)", optim_b, 0 if off else optim_b,
             0 if off else optim_b, f"12 B/param {shard}, Megatron dist_optimizer.md"),
        part("activations", f"activations ({layers} layers x {in_flight} in flight)", activations, 0, 0,
             f"{o.recompute} recompute, Korthikanti+22 Tab. 2"),
    ]
    if last:
        parts.append(part("logits", "logits (fp32, loss)", logits, 0, 0, "4sbv/t, Korthikanti+22 Sec. 4.3"))
    sync_buffer = 2 * max(o.sync_bucket_bytes, BF16 * max(padded_vocab * h, 2 * arch.intermediate_size * h))
    parts += [
        part("engine_weights", f"vLLM weights (bf16, engine TP={engine_tp})", sleeping * engine_weights,
             engine_weights, engine_weights, "sleep frees them in training"),
        part("kv_cache", "vLLM KV cache", sleeping * kv_bytes, kv_bytes, 0,
             f"{o.gpu_memory_utilization:g} x GPU - vLLM weights"),
        part("sync_buffer", "weight-sync buckets", 0, 0, sync_buffer, "gathered bucket + HF copy"),
    ]
    if o.drafter:
        n = drafter_parameters(arch)
        state = o.drafter_bytes_per_param * n
        heads = BF16 * arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2)
        features = BF16 * o.drafter_buffer_tokens * h
        t = o.drafter_pack_tokens
        # one layer's activations on a pack (Korthikanti's 34 + 5as/h per token, b=1, t=1) plus ~5 fp32
        # vocabulary-sized rows per token in the loss (target logits and probs, drafter logits and log-softmax,
        # their product: megatron_tlt/drafter/loss.py)
        working = t * h * (34 + 5 * arch.num_attention_heads * t / h) + 5 * FP32 * t * arch.vocab_size
        parts += [
            part("drafter_state", "EAGLE drafter (weights, grads, Adam)", state, state, state,
                 f"{n / 1e9:.2f}B params x {o.drafter_bytes_per_param:g} B"),
            part("drafter_heads", "drafter's embedding + LM head copy", heads, heads, heads,
                 "bf16, drafter/trainer.py"),
            part("drafter_buffer", f"drafter feature buffer ({o.drafter_buffer_tokens} tokens)", features, features,
                 features, "bf16 x hidden"),
            # The log-prob pass captures (last stage) or receives (other stages) at most a buffer's worth of
            # new features, held beside the buffer until it has copied them in: rl/actor.py. Counted at the
            # training peak although the pass ends before the backward, so an upper bound.
            part("drafter_features", "new features of the log-prob pass", features, 0, 0,
                 "<= buffer, until buffered"),
            part("drafter_work", "drafter training step (spot)", 0, working, 0,
                 f"{t}-token pack, idle ranks"),
        ]
    overhead = o.overhead_gib * GIB
    parts.append(part("overhead", "CUDA context + NCCL + allocator", overhead, overhead, overhead,
                      f"stated constant {o.overhead_gib:g} GiB"))
    return parts


_ADVICE = {
    "weights": "raise TP or PP to split the model over more GPUs",
    "grads": "raise TP or PP to split the model over more GPUs",
    "optimizer": "raise TP or PP to split the model over more GPUs, or keep --distributed-optimizer on with more DP",
    "activations": ("raise TP (sequence parallel divides activations by TP; under 1F1B the first stage keeps "
                    "L layers' worth whatever the PP), lower --micro-batch-size or --seq-len, or use --recompute full"),
    "logits": "raise TP or lower --seq-len / --micro-batch-size",
    "engine_weights": "lower --gpu-memory-utilization or raise the engine TP",
    "kv_cache": "lower --gpu-memory-utilization",
    "sync_buffer": "lower the weight-sync bucket size",
    "drafter_state": "lower --drafter-bytes-per-param (bf16 Adam moments: 8) or turn the drafter off (--no-drafter)",
    "drafter_heads": "turn the drafter off (--no-drafter)",
    "drafter_buffer": "lower --drafter-buffer-tokens",
    "drafter_features": "lower --drafter-buffer-tokens",
    "drafter_work": "lower --drafter-pack-tokens",
    "overhead": "use a GPU with more memory",
}


def refusal(plan: LayoutPlan) -> str:
    """The one-sentence reason a plan that does not fit is refused (memory first, then the engine's KV cache)."""
    if plan.fits_memory and plan.engine_problem:
        return f"{plan.summary()} refused: {plan.engine_problem}"
    part, phase = plan.biggest_part, plan.peak_phase
    return (f"{plan.summary()} needs {plan.peak_gib:.1f} GiB per GPU in the {phase} phase"
            + (f" ({plan.stage} pipeline stage)" if plan.pp > 1 else "") + f", more than the {plan.options.gpu_memory_gib:g} GiB GPU; the biggest part is {part.label} at "
            f"{part.gib[phase]:.1f} GiB: {_ADVICE[part.key]}")


def require_fit(plan: LayoutPlan) -> LayoutPlan:
    if not plan.fits:
        raise PlanError(refusal(plan))
    return plan


def valid_layouts(arch: PolicyArchitecture, *, nodes: int, gpus_per_node: int, tp: int | None = None,
                  pp: int | None = None, engine_tp: int | None = None) -> list[tuple[int, int]]:
    """Every (TP, PP) that passes ``check_layout``, optionally with one of the two fixed."""
    world = nodes * gpus_per_node
    tps = [tp] if tp else [t for t in range(1, gpus_per_node + 1) if gpus_per_node % t == 0]
    pps = [pp] if pp else [p for p in range(1, arch.num_layers + 1) if world % p == 0]
    out = []
    for t in tps:
        for p in pps:
            try:
                check_layout(arch, nodes=nodes, gpus_per_node=gpus_per_node, tp=t, pp=p, engine_tp=engine_tp or t)
            except PlanError:
                continue
            out.append((t, p))
    return out


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
            check_engine_tp(arch, engine_tp=options.engine_tp, gpus_per_node=gpus_per_node)
        fixed = " with " + " ".join(f"{k}={v}" for k, v in (("TP", tp), ("PP", pp)) if v) if (tp or pp) else ""
        raise PlanError(f"no valid layout{fixed} for {_cluster(nodes, gpus_per_node)}: TP must divide the heads "
                        f"and the GPUs of a node, PP the {arch.num_layers} layers, and TP x PP the GPUs")
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


# ----------------------------------------------------------------------------- output


def _trainer_gaps(o: PlanOptions, tp: int) -> list[str]:
    """What the estimate assumes that ``tlt train`` does not do yet: it builds the policy from Megatron's
    local layer spec (mcore.py), without sequence parallelism or selective recompute, whose
    activations at long sequences are several times these (see README, "Known gaps")."""
    missing = []
    if o.recompute == "selective":
        missing.append("selective recompute")
    if o.sequence_parallel and tp > 1:
        missing.append("sequence parallelism")
    if o.distributed_optimizer:
        missing.append("the distributed optimizer")
    if not missing:
        return []
    return [f"  note: tlt train does not turn on {' or '.join(missing)} yet; the activations and state above "
            f"assume them (README, Known gaps)"]


def render(plan: LayoutPlan, alternatives: Sequence[LayoutPlan] | None = None, *, chosen_by_search: bool = False) -> str:
    o, arch = plan.options, plan.arch
    chosen = "  (chosen: the smallest TP x PP that fits, ties to the smaller PP)" if chosen_by_search else ""
    stage_params = ", ".join(f"{n / 1e9:.2f}B" for n in _stage_summary(plan.stage_params))
    sp = "on" if o.sequence_parallel and plan.tp > 1 else "off"
    table_title = f"{plan.stage} pipeline stage (the worst)" if plan.pp > 1 else "one pipeline stage"
    lines = [
        (f"model: {plan.model_name} ({arch.architecture}, {count_parameters(arch) / 1e9:.2f}B parameters, "
         f"{arch.num_layers} layers, {arch.num_attention_heads} heads / {arch.num_kv_heads} KV heads)"),
        (f"cluster: {_cluster(plan.nodes, plan.gpus_per_node)} = {plan.world_size} GPUs of "
         f"{o.gpu_memory_gib:g} GiB"),
        f"layout: TP={plan.tp} PP={plan.pp} DP={plan.dp}{chosen}",
        (f"  pipeline stages: {plan.pp}, {plan.layers_per_stage} layers per stage; parameters per GPU "
         f"(first, ..., last stage): {stage_params}"),
        (f"  vLLM engines: TP={plan.engine_tp}, {plan.engines_per_node} per node, "
         f"{plan.world_size // plan.engine_tp} in all; KV cache for {plan.kv_cache_tokens:,} tokens per engine"),
        (f"  training: micro-batch {o.micro_batch_size} x {o.seq_len} tokens, recompute={o.recompute}, "
         f"sequence parallel {sp}, distributed optimizer {'on' if o.distributed_optimizer else 'off'}"),
        *_trainer_gaps(o, plan.tp),
        "",
        f"memory per GPU (GiB), {table_title}:",
    ]
    width = max(len(p.label) for p in plan.parts) + 2
    lines.append(f"  {'part':<{width}}{'training':>9}{'rollout':>9}{'sync':>9}   source")
    for p in plan.parts:
        cells = "".join(f"{p.gib[ph]:>9.1f}" if p.gib[ph] else f"{'-':>9}" for ph in PHASES)
        lines.append(f"  {p.label:<{width}}{cells}   {p.source}")
    totals = "".join(f"{plan.phase_gib(ph):>9.1f}" for ph in PHASES)
    lines.append(f"  {'total':<{width}}{totals}")
    verdict = "fits" if plan.fits_memory else "DOES NOT FIT"
    lines.append(f"peak: {plan.peak_gib:.1f} GiB ({plan.peak_phase} phase) of {o.gpu_memory_gib:g} GiB: {verdict} "
                 f"({o.gpu_memory_gib - plan.peak_gib:+.1f} GiB headroom)")
    if plan.engine_problem:
        lines.append(f"rollout engine: {plan.engine_problem}")

    if o.sleep_level == 0:
        vllm_in_training = "stays awake (sleep level 0): its whole budget stays taken"
    else:
        kept = "a copy of its weights kept in host RAM" if o.sleep_level == 1 else "its weights discarded"
        vllm_in_training = f"sleeps at level {o.sleep_level}: weights and KV cache leave the GPU ({kept})"
    megatron_in_rollout = "offloaded to host RAM" if o.offload_training_state else "kept on the GPU"
    drafter_in_rollout = "; idle ranks train the drafter" if o.drafter else ""
    resident = " and the drafter (state, head copies, feature buffer)" if o.drafter else ""
    lines += [
        "",
        "how the phases share the GPU (colocated; peak = the largest phase total):",
        f"  training (log-prob + update): Megatron's weights, grads, optimizer, activations; vLLM {vllm_in_training}",
        (f"  rollout: vLLM awake in its {o.gpu_memory_utilization:g} x GPU budget; Megatron's weights, grads and "
         f"optimizer {megatron_in_rollout}{drafter_in_rollout}"),
        "  sync: Megatron's bf16 weights and vLLM's weights on the GPU together while buckets stream",
        f"  resident in every phase: CUDA/NCCL overhead{resident}",
        f"  host RAM per node for what is offloaded: {plan.host_gib_per_node:.0f} GiB",
    ]
    if alternatives is not None:
        lines.append("")
        if alternatives:
            lines.append("other layouts that fit:")
            lines += [f"  {a.summary()}: peak {a.peak_gib:.1f} GiB ({a.peak_phase})" for a in alternatives]
        else:
            lines.append("no other layout fits")
    return "\n".join(lines)


def _stage_summary(stage_params: list[int]) -> list[int]:
    if len(stage_params) <= 2:
        return stage_params
    return [stage_params[0], stage_params[1], stage_params[-1]]


# ----------------------------------------------------------------------------- command line


DESCRIPTION = "Choose a TP/PP/DP layout for a model on a cluster and estimate memory per GPU."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tlt plan", description=DESCRIPTION)
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tlt plan`` (the ``tlt`` parser adds them to its ``plan`` subcommand)."""
    d = PlanOptions()
    parser.add_argument("--model", required=True,
                        help="HF model directory, its config.json, or a name under launch/models (e.g. llama-3.3-70b)")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, required=True)
    parser.add_argument("--tp", type=int, help="tensor-parallel size (default: searched)")
    parser.add_argument("--pp", type=int, help="pipeline-parallel size (default: searched)")
    parser.add_argument("--gpu-memory-gib", type=float, default=d.gpu_memory_gib)
    parser.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size)
    parser.add_argument("--seq-len", type=int, default=d.seq_len, help="prompt + response tokens")
    parser.add_argument("--recompute", choices=RECOMPUTE_CHOICES, default=d.recompute)
    parser.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=d.sequence_parallel)
    parser.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction,
                        default=d.distributed_optimizer)
    parser.add_argument("--engine-tp", type=int, help="vLLM engine TP (default: the training TP)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    parser.add_argument("--sleep-level", type=int, choices=(0, 1, 2), default=d.sleep_level)
    parser.add_argument("--offload-training-state", action=argparse.BooleanOptionalAction,
                        default=d.offload_training_state)
    parser.add_argument("--drafter", action=argparse.BooleanOptionalAction, default=d.drafter)
    parser.add_argument("--drafter-bytes-per-param", type=float, default=d.drafter_bytes_per_param)
    parser.add_argument("--drafter-buffer-tokens", type=int, default=d.drafter_buffer_tokens)
    parser.add_argument("--drafter-pack-tokens", type=int, default=d.drafter_pack_tokens)
    parser.add_argument("--overhead-gib", type=float, default=d.overhead_gib)


def main(argv: Sequence[str] | None = None) -> int:
    """``tlt plan``: 0 with the plan on stdout; 2 with one ``tlt plan: error: ...`` line on stderr."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Plan for parsed ``tlt plan`` arguments; 0 when the layout fits, 2 with the reason when refused."""
    options = PlanOptions(
        gpu_memory_gib=args.gpu_memory_gib, micro_batch_size=args.micro_batch_size, seq_len=args.seq_len,
        recompute=args.recompute, sequence_parallel=args.sequence_parallel,
        distributed_optimizer=args.distributed_optimizer, engine_tp=args.engine_tp,
        gpu_memory_utilization=args.gpu_memory_utilization, sleep_level=args.sleep_level,
        offload_training_state=args.offload_training_state, drafter=args.drafter,
        drafter_bytes_per_param=args.drafter_bytes_per_param, drafter_buffer_tokens=args.drafter_buffer_tokens,
        drafter_pack_tokens=args.drafter_pack_tokens, overhead_gib=args.overhead_gib)
    try:
        arch, name = resolve_model(args.model)
        if args.tp and args.pp:
            plan = plan_layout(arch, nodes=args.nodes, gpus_per_node=args.gpus_per_node, tp=args.tp, pp=args.pp,
                               options=options, model_name=name)
            print(render(plan))  # a refused plan too: its table shows where the memory goes
            require_fit(plan)
        else:
            plan, alternatives = search_layouts(arch, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                                                tp=args.tp, pp=args.pp, options=options, model_name=name)
            print(render(plan, alternatives, chosen_by_search=True))
    except (PlanError, ModelConfigError) as err:
        sys.stdout.flush()
        print(f"tlt plan: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
