"""The one adapter to Megatron-Core: build the policy, run its schedules, save and load it.

Nothing else in megatron_tlt imports ``megatron.core`` (the CPU shim aside), so an upgrade of
Megatron-Core touches this file only. The policy is built from Megatron's *local* layer spec (pure
PyTorch modules, the same on CPU and GPU) with two of its modules replaced (``model/layers.py``): core attention
on ``scaled_dot_product_attention`` (``attention="sdpa"``, the default: no [s, s] score matrices kept) and
an RMSNorm that allows sequence parallelism. Parameter names are the local spec's (``linear_qkv``,
``linear_fc1``, ``input_layernorm`` ...) whatever the options, and ``formats/weights.py`` maps them to HF.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from megatron_tlt.formats.architecture import PolicyArchitecture
from megatron_tlt.model.build_options import BuildOptions
from megatron_tlt.model.layers import SDPACoreAttention, SequenceParallelRMSNorm

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
def te_attention_unavailable_reason() -> str | None:
    """Why Transformer Engine's attention cannot be used here (None when it can)."""
    if not torch.cuda.is_available():
        return "Transformer Engine attention needs a CUDA GPU"
    try:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention  # noqa: F401
    except ImportError as err:
        return f"Transformer Engine does not import ({err}); use model.attention=sdpa"
    return None


def _recompute_settings(recompute: str) -> dict[str, Any]:
    if recompute == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    if recompute == "full":  # every layer its own recompute unit: it keeps only its input
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageInfo:
    """Where this rank's model piece sits in the tensor/pipeline layout."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


# ----------------------------------------------------------------------------- parallel state


def initialize_model_parallel(*, tensor_parallel_size: int, pipeline_parallel_size: int, seed: int) -> None:
    """Create Megatron's TP/PP/DP groups on the already-initialised default process group."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel_size,
        pipeline_model_parallel_size=pipeline_parallel_size,
    )
    # Megatron's seed gives each TP rank its own stream; the CPU generator is seeded after it so that
    # data-parallel replicas initialise identical weights (see DESIGN.md section 3).
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def destroy_model_parallel() -> None:
    parallel_state.destroy_model_parallel()


def stage_info() -> StageInfo:
    return StageInfo(
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
    )


def tensor_parallel_group():
    return parallel_state.get_tensor_model_parallel_group()


def pipeline_parallel_group():
    return parallel_state.get_pipeline_model_parallel_group()


def model_parallel_group():
    """The tp x pp ranks that together hold one replica of the policy."""
    return parallel_state.get_model_parallel_group()


def data_parallel_rank() -> int:
    return parallel_state.get_data_parallel_rank()


def data_parallel_size() -> int:
    return parallel_state.get_data_parallel_world_size()


def broadcast_from_last_stage(tensor: torch.Tensor) -> None:
    """In place: every pipeline stage receives the last stage's ``tensor``."""
    group = parallel_state.get_pipeline_model_parallel_group()
    if torch.distributed.get_world_size(group) > 1:
        src = torch.distributed.get_global_rank(group, torch.distributed.get_world_size(group) - 1)
        torch.distributed.broadcast(tensor, src=src, group=group)


# ----------------------------------------------------------------------------- model


def transformer_config(arch: PolicyArchitecture, *, dtype: str = "float32", options: BuildOptions = BuildOptions(),
                       **overrides: Any) -> TransformerConfig:
    """Megatron's TransformerConfig for a Llama/Qwen2 decoder at the current parallel layout."""
    params_dtype = DTYPES[dtype]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    on_gpu = torch.cuda.is_available()
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=params_dtype,
        params_dtype=params_dtype,
        bf16=params_dtype is torch.bfloat16,
        fp16=params_dtype is torch.float16,
        # Fusions are CUDA kernels; the unfused paths compute the same function.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # Weights are loaded from checkpoints; CPU init keeps TP=1 and TP=2 bit-identical anyway.
        use_cpu_initialization=not on_gpu,
        sequence_parallel=options.sequence_parallel and tp > 1,
        **_recompute_settings(options.recompute),
        **overrides,
    )


def _apply_llama3_rope_scaling(model: GPTModel, arch: PolicyArchitecture) -> None:
    """Megatron hard-codes Llama-3.1's low/high frequency factors; use the config's own."""
    if arch.rope_scaling is None or not hasattr(model, "rotary_pos_emb"):
        return
    rope = model.rotary_pos_emb
    dim = arch.head_dim
    base = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=rope.inv_freq.device) / dim))
    s = arch.rope_scaling
    rope.inv_freq = rope._apply_scaling(
        base,
        factor=s.factor,
        low_freq_factor=s.low_freq_factor,
        high_freq_factor=s.high_freq_factor,
        original_max_position_embeddings=s.original_max_position_embeddings,
    )
    rope.forward.cache_clear()  # forward is lru_cached on sequence length


def _block_spec(config: TransformerConfig, options: BuildOptions) -> TransformerBlockSubmodules:
    """This stage's layers: Megatron's local layer spec with our core attention and norms (``model/layers.py``)."""
    layer = get_gpt_layer_local_spec(normalization="RMSNorm")
    layer.submodules.input_layernorm = SequenceParallelRMSNorm
    layer.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    if options.attention == "sdpa":
        layer.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    elif options.attention == "te":
        reason = te_attention_unavailable_reason()
        if reason:
            raise ValueError(reason)
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        layer.submodules.self_attention.submodules.core_attention = TEDotProductAttention
    # The final norm is given too: Megatron's default for it is TE's norm where TE is installed.
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config),
                                      layer_norm=SequenceParallelRMSNorm)


def build_gpt_model(arch: PolicyArchitecture, *, dtype: str = "float32", padded_vocab_size: int,
                    per_token_loss: bool = False, options: BuildOptions = BuildOptions()) -> GPTModel:
    """This rank's stage of the policy as a Megatron GPTModel (``_block_spec``, built as ``options`` say).

    ``per_token_loss`` switches on Megatron's ``calculate_per_token_loss``: loss functions return a
    (sum, count) pair and gradients are divided by the count summed over the whole global batch.
    """
    config = transformer_config(arch, dtype=dtype, options=options, calculate_per_token_loss=per_token_loss)
    stage = stage_info()
    model = GPTModel(
        config=config,
        transformer_layer_spec=_block_spec(config, options),
        vocab_size=padded_vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=stage.is_first_stage,
        post_process=stage.is_last_stage,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
        rope_scaling=arch.rope_scaling is not None,
    )
    _apply_llama3_rope_scaling(model, arch)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def unwrap(model: torch.nn.Module) -> GPTModel:
    """The GPTModel inside DDP/Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def wrap_ddp(model: GPTModel, *, grad_reduce_in_fp32: bool = True,
             distributed_optimizer: bool = False) -> DistributedDataParallel:
    """Megatron DDP around the model, wired into the config the schedules read.

    The schedules call ``finalize_model_grads_func`` after the last backward (data-parallel grad
    all-reduce, and the tied-embedding grad all-reduce between first and last pipeline stage) and
    ``no_sync_func`` to skip the reduction while accumulating over micro-batches; Megatron-LM's
    training loop sets both, so we must too. With ``distributed_optimizer`` the gradients are
    reduce-scattered over DP (each rank keeps the slice its optimizer shard updates) and ``build_optimizer``
    must be called with it too.
    """
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
    )
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    return ddp


def build_optimizer(model: DistributedDataParallel, *, lr: float, weight_decay: float = 0.0,
                    clip_grad: float = 1.0, adam_beta1: float = 0.9, adam_beta2: float = 0.999, min_lr: float = 0.0):
    """Megatron's Adam; distributed (fp32 master weights and moments sharded over DP, ZeRO-1) when the
    DDP wrapper was built for it (``wrap_ddp(distributed_optimizer=True)``)."""
    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=min_lr,  # the param groups carry max/min lr; Megatron's LR scheduler reads them
        weight_decay=weight_decay,
        clip_grad=clip_grad,
        adam_beta1=adam_beta1,
        adam_beta2=adam_beta2,
        params_dtype=model.config.params_dtype,
        bf16=model.config.bf16,
        fp16=model.config.fp16,
        use_distributed_optimizer=model.ddp_config.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(config, [model])
    model.config.grad_scale_func = optimizer.scale_loss  # fp16 loss scaling; identity otherwise
    return optimizer


def _optimizers(optimizer) -> list:
    """The optimizers inside Megatron's ChainedOptimizer (one per parameter dtype group), or the one given."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def is_distributed_optimizer(optimizer) -> bool:
    return any(isinstance(o, DistributedOptimizer) for o in _optimizers(optimizer))


def _owned_parameters(optimizer: DistributedOptimizer) -> list[torch.nn.Parameter]:
    """The parameters whose (slice of) master weights and moments this DP rank owns, in buffer order."""
    return [param for gbuf_range_maps in optimizer.gbuf_ranges for by_dtype in gbuf_range_maps.values()
            for bucket in by_dtype for param in bucket["param_map"]]


def optimizer_state(optimizer) -> dict:
    """This rank's Adam state, to ``torch.save``. The distributed optimizer keeps its parameter state (fp32
    master weights, moments) apart from ``state_dict()``: each DP rank saves the slices it owns.

    Megatron 0.16's own ``get/load_parameter_state_dp_reshardable`` do not round-trip (the loader reads a
    'padding' key the getter never writes), so the per-parameter getter and setter they use are called here.
    """
    state = {"state_dict": optimizer.state_dict()}
    if is_distributed_optimizer(optimizer):
        # Copies of the owned slices: fp32 master weights are views into the whole parameter buffer, which
        # torch.save would otherwise write out entire on every rank.
        state["parameter_state"] = [[{k: v.detach().clone() if torch.is_tensor(v) else v
                                      for k, v in inner._get_main_param_and_optimizer_states(p).items()}
                                     for p in _owned_parameters(inner)] for inner in _optimizers(optimizer)]
    return state


def load_optimizer_state(optimizer, state: dict) -> None:
    """Restore what ``optimizer_state`` saved, into an optimizer built the same way at the same layout."""
    optimizer.load_state_dict(state["state_dict"])
    for inner, saved in zip(_optimizers(optimizer), state.get("parameter_state", [])):
        owned = _owned_parameters(inner)
        if len(owned) != len(saved):
            raise ValueError(f"optimizer state holds {len(saved)} parameter shards, this rank owns {len(owned)}: "
                             "saved at another data-parallel size or model")
        with torch.no_grad():  # fp32 master weights are views of the model's own parameters
            for param, tensors in zip(owned, saved):
                inner._set_main_param_and_optimizer_states(param, tensors)
        # Megatron's load_state_dict gives every parameter the same 'step' tensor, which torch's Adam then
        # advances once per parameter per step (bias correction drifts): each gets its own.
        for param_state in inner.optimizer.state.values():
            if torch.is_tensor(param_state.get("step")):
                param_state["step"] = param_state["step"].clone()


def build_lr_scheduler(optimizer, *, lr: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0,
                       style: str = "cosine") -> OptimizerParamScheduler:
    """Megatron's learning-rate schedule: linear warm-up to ``lr``, then ``style`` decay to ``min_lr``;
    call ``.step(1)`` after every optimizer step."""
    wd = optimizer.param_groups[0]["weight_decay"] if optimizer.param_groups else 0.0
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=warmup_steps,
        lr_decay_steps=max(total_steps, warmup_steps + 1), lr_decay_style=style,
        start_wd=wd, end_wd=wd, wd_incr_steps=1, wd_incr_style="constant",
    )


# ----------------------------------------------------------------------------- schedules

ForwardStep = Callable[[Iterator, torch.nn.Module], tuple[torch.Tensor, Callable]]


def run_schedule(model: torch.nn.Module, forward_step: ForwardStep, microbatches: list[Any], *,
                 seq_length: int, micro_batch_size: int, forward_only: bool) -> list[Any]:
    """Megatron's forward(/backward) schedule over ``microbatches`` (1F1B when PP > 1).

    Returns what the loss function reported for each micro-batch on the last pipeline stage
    (an empty list on the other stages).
    """
    forward_backward = get_forward_backward_func()
    return forward_backward(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=[model],
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def position_ids_like(input_ids: torch.Tensor) -> torch.Tensor:
    b, s = input_ids.shape
    return torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)


def gather_vocab_logits(logits_bsv: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full-vocabulary logits from this rank's vocab-parallel shard, padding rows dropped."""
    full = tensor_parallel.gather_from_tensor_model_parallel_region(logits_bsv)
    return full[..., :vocab_size]


def vocab_parallel_cross_entropy(logits_bsv: torch.Tensor, labels_bs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Per-token cross-entropy on vocab-parallel logits, without gathering them.

    The rows that pad the vocabulary to a multiple of 128 x TP are masked out: their logits would
    otherwise take probability mass from the real tokens.
    """
    logits = logits_bsv.float()
    shard = logits.shape[-1]
    first = parallel_state.get_tensor_model_parallel_rank() * shard
    if first + shard > vocab_size:
        padded = torch.arange(first, first + shard, device=logits.device) >= vocab_size
        logits = logits.masked_fill(padded, torch.finfo(logits.dtype).min)
    return tensor_parallel.vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(),
                                                        labels_bs.transpose(0, 1).contiguous()).transpose(0, 1)


def sequence_multiple(model: torch.nn.Module) -> int:
    """What the model input's sequence length must be a multiple of: the TP size with sequence parallelism
    (Megatron scatters the embedded sequence over the TP ranks), else 1. Batch builders pad to it."""
    config = unwrap(model).config
    return config.tensor_model_parallel_size if config.sequence_parallel else 1


def full_sequence(hidden_sbh: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """The whole [s, b, h] sequence of an activation inside the decoder: with sequence parallelism each TP
    rank holds only its [s / TP, b, h] slice, so they are gathered (collective over the TP group)."""
    if not unwrap(model).config.sequence_parallel:
        return hidden_sbh
    return tensor_parallel.gather_from_sequence_parallel_region(hidden_sbh, tensor_parallel_output_grad=False)


# ----------------------------------------------------------------------------- checkpoints


def save_distributed(model: torch.nn.Module, checkpoint_dir: str | Path) -> None:
    """Write this rank's shards of the model into a Megatron distributed checkpoint (collective)."""
    Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(unwrap(model).sharded_state_dict(), str(checkpoint_dir))


def load_distributed(model: torch.nn.Module, checkpoint_dir: str | Path) -> None:
    """Fill the model from a distributed checkpoint written at any TP/PP layout (collective)."""
    target = unwrap(model)
    state = dist_checkpointing.load(target.sharded_state_dict(), str(checkpoint_dir))
    target.load_state_dict(state, strict=True)
