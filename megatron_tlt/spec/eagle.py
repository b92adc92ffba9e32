"""The EAGLE-1 drafter as vLLM 0.32 serves it: its config, its tensors, and the live swap.

vLLM's EagleLlamaForCausalLM computes ``fc(cat(embed(next_token), feature))`` -> one decoder layer
without its first input norm -> + residual -> the target's LM head (no norm). The drafter checkpoint
holds ``fc.weight`` [H, 2H] and ``layers.0.*`` only: the embedding and LM head are the target's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_tlt.formats.architecture import PolicyArchitecture

if TYPE_CHECKING:
    import torch


class DrafterMismatch(ValueError):
    """A drafter that does not fit the policy it is meant to draft for."""


def eagle_drafter_config(arch: PolicyArchitecture) -> dict:
    """HF config of the policy's EAGLE-1 drafter: one decoder layer of the policy's shape.

    vLLM 0.32 maps a Llama-architecture draft model to its EagleLlamaForCausalLM when the
    speculative method is "eagle"; the embedding and LM head are the target's (not in the drafter).
    """
    config = dict(arch.hf_config)
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
                  tie_word_embeddings=False)
    return config


def expected_drafter_shapes(arch: PolicyArchitecture) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of an EAGLE drafter for this policy (vLLM names, no ``model.`` prefix)."""
    h, hd = arch.hidden_size, arch.head_dim
    layer = "layers.0."
    shapes = {
        "fc.weight": (h, 2 * h),
        layer + "post_attention_layernorm.weight": (h,),
        layer + "self_attn.q_proj.weight": (arch.num_attention_heads * hd, h),
        layer + "self_attn.k_proj.weight": (arch.num_kv_heads * hd, h),
        layer + "self_attn.v_proj.weight": (arch.num_kv_heads * hd, h),
        layer + "self_attn.o_proj.weight": (h, arch.num_attention_heads * hd),
        layer + "mlp.gate_proj.weight": (arch.intermediate_size, h),
        layer + "mlp.up_proj.weight": (arch.intermediate_size, h),
        layer + "mlp.down_proj.weight": (h, arch.intermediate_size),
    }
    if arch.qkv_bias:
        for proj, heads in (("q", arch.num_attention_heads), ("k", arch.num_kv_heads), ("v", arch.num_kv_heads)):
            shapes[f"{layer}self_attn.{proj}_proj.bias"] = (heads * hd,)
    return shapes


def validate_drafter(arch: PolicyArchitecture, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse a drafter that does not fit the policy (hidden size, vocabulary, layer shapes)."""
    fc = tensors.get("fc.weight")
    if fc is None:
        raise DrafterMismatch("drafter has no fc.weight: not an EAGLE drafter")
    if tuple(fc.shape) != (arch.hidden_size, 2 * arch.hidden_size):
        raise DrafterMismatch(
            f"drafter hidden size does not match the policy: fc.weight is {tuple(fc.shape)}, "
            f"policy hidden_size {arch.hidden_size} needs ({arch.hidden_size}, {2 * arch.hidden_size})"
        )
    embed = tensors.get("embed_tokens.weight")
    if embed is not None and tuple(embed.shape) != (arch.vocab_size, arch.hidden_size):
        raise DrafterMismatch(
            f"drafter vocabulary does not match the policy: embed_tokens.weight is {tuple(embed.shape)}, "
            f"policy needs ({arch.vocab_size}, {arch.hidden_size})"
        )
    if "lm_head.weight" in tensors:
        raise DrafterMismatch("drafter carries lm_head.weight; an EAGLE drafter shares the policy's LM head")
    expected = expected_drafter_shapes(arch)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise DrafterMismatch(f"drafter is missing tensors: {', '.join(missing)}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise DrafterMismatch(f"drafter tensor {name} has shape {tuple(tensors[name].shape)}, policy needs {shape}")
