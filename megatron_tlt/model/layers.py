"""The policy's own layer modules for Megatron's layer spec: SDPA core attention, and an RMSNorm that allows
sequence parallelism.

Core attention on ``torch.nn.functional.scaled_dot_product_attention``, in Megatron's core-attention slot.

Megatron-Core's local ``DotProductAttention`` materialises the [b, heads, s, s] score matrix and keeps
its softmax (fp32) and probabilities for the backward pass: at 4096 tokens that is most of a layer's
activation memory. SDPA computes the same causal attention blockwise (flash / memory-efficient kernels on
GPU, a flash kernel on CPU) and keeps only its inputs, output and one log-sum-exp per query row, so
activations grow linearly with the sequence. It is a plain ``torch.nn.Module``: it has no parameters, so
the policy's parameter names, checkpoints and weight maps are the same with either attention.

The module follows Megatron's ``CoreAttention`` contract (``megatron/core/transformer/attention.py``):
query [sq, b, heads, d], key/value [sk, b, kv_heads, d] of this tensor-parallel rank, output
[sq, b, heads * d]. Only causal self-attention without an explicit mask is supported, which is all the
policy runs (sequences are right-padded; causal attention hides the padding from real positions).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _no_blockwise_gqa_kernel(query: torch.Tensor) -> bool:
    """True where SDPA would answer grouped KV heads (``enable_gqa``) with its math kernel, which keeps the
    [b, heads, s, s] scores: on CUDA in fp32 (flash takes only fp16/bf16; the memory-efficient kernel takes
    fp32 but not ``enable_gqa``). Measured on an H200: a 4096-token fp32 step then kept 2.4x the planned
    activations. Copying the grouped heads out (2 x [b, heads, s, d], linear in s) lets the memory-efficient
    kernel run. On CPU the flash kernel takes grouped heads in fp32; on CUDA in bf16/fp16 flash takes them."""
    return query.is_cuda and query.dtype not in (torch.float16, torch.bfloat16)


class SDPACoreAttention(torch.nn.Module):
    """Causal attention through ``F.scaled_dot_product_attention`` (built by Megatron's layer spec)."""

    def __init__(self, *, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 cp_comm_type=None, softmax_scale: float | None = None, pg_collection=None, **_unused):
        super().__init__()
        if config.context_parallel_size != 1:
            raise ValueError("SDPA core attention does not implement context parallelism")
        if attn_mask_type.name != "causal":
            raise ValueError(f"SDPA core attention runs causal self-attention only, got {attn_mask_type.name}")
        self.config = config  # Megatron's checkpointing and hooks read module.config
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask=None,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> torch.Tensor:
        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPA core attention takes no explicit mask, bias or packed sequences")
        sq, b, heads, d = query.shape
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        grouped = k.shape[1] != heads
        if grouped and _no_blockwise_gqa_kernel(q):
            k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
            grouped = False
        out_bnsd = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                  enable_gqa=grouped)
        return out_bnsd.permute(2, 0, 1, 3).reshape(sq, b, heads * d)


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm built the way Megatron's layer spec builds norms, and usable with sequence parallelism.

    Megatron's ``WrappedTorchNorm`` refuses sequence parallelism. Nothing in the norm needs to know about
    it: each tensor-parallel rank normalises its own slice of the tokens; only the weight's gradient is
    partial per rank, and Megatron all-reduces it over the TP group for parameters marked
    ``sequence_parallel`` (``finalize_model_grads``). Same class, parameter names and numerics as the
    local spec's norm otherwise.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)
