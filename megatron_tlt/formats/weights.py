"""HF <-> Megatron weight names and shapes for Llama/Qwen2, as data plus a few pure functions.

Three representations meet here:
  * **HF**: ``model.layers.{i}.self_attn.q_proj.weight`` ... separate q/k/v and gate/up tensors;
  * **Megatron full**: Megatron's names (local layer spec) with *global* layer numbers, each tensor
    whole, i.e. what a TP=1/PP=1 model holds: q/k/v fused per query group, gate/up stacked,
    vocabulary rows padded;
  * **Megatron shard**: what one (tp_rank, pp_rank) holds: local layer numbers, TP slices.

``to_megatron_full``/``to_hf`` convert tensor by tensor, so a converter or a weight sync can stream
through a model without holding a second copy. Used by ``checkpoints_tools`` and ``rl/weight_sync``.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterator

import torch

from megatron_tlt.formats.architecture import PolicyArchitecture

TensorGetter = Callable[[str], torch.Tensor]


class TPSplit(enum.Enum):
    """How a Megatron tensor is divided across tensor-parallel ranks."""

    REPLICATED = "replicated"
    ROWS = "rows"  # dim 0: column-parallel outputs, vocab-parallel embeddings, fused qkv
    COLUMNS = "columns"  # dim 1: row-parallel inputs (linear_proj, linear_fc2)
    GATE_UP = "gate_up"  # dim 0 of each of the stacked gate and up halves


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Per-layer Megatron suffix -> (HF suffixes it is made of, TP split)
_LAYER_TABLE: dict[str, tuple[tuple[str, ...], TPSplit]] = {
    "input_layernorm.weight": (("input_layernorm.weight",), TPSplit.REPLICATED),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        TPSplit.ROWS,
    ),
    "self_attention.linear_qkv.bias": (
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        TPSplit.ROWS,
    ),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), TPSplit.COLUMNS),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), TPSplit.REPLICATED),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), TPSplit.GATE_UP),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), TPSplit.COLUMNS),
}

_GLOBAL_TABLE: dict[str, tuple[str, TPSplit]] = {
    "embedding.word_embeddings.weight": ("model.embed_tokens.weight", TPSplit.ROWS),
    "decoder.final_layernorm.weight": ("model.norm.weight", TPSplit.REPLICATED),
    "output_layer.weight": ("lm_head.weight", TPSplit.ROWS),
}

_VOCAB_PADDED = {"embedding.word_embeddings.weight", "output_layer.weight"}


def megatron_names(arch: PolicyArchitecture) -> list[str]:
    """Every Megatron-full tensor name of the model, in layer order."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(arch.num_layers):
        for suffix in _LAYER_TABLE:
            if suffix.endswith(".bias") and not arch.qkv_bias:
                continue
            names.append(f"decoder.layers.{i}.{suffix}")
    names.append("decoder.final_layernorm.weight")
    if not arch.tie_word_embeddings:
        names.append("output_layer.weight")
    return names


def hf_names(arch: PolicyArchitecture) -> list[str]:
    """Every HF tensor name the model must have."""
    names = []
    for name in megatron_names(arch):
        names.extend(hf_sources(arch, name))
    return names


def hf_sources(arch: PolicyArchitecture, megatron_name: str) -> tuple[str, ...]:
    """The HF tensors a Megatron-full tensor is built from."""
    match = _LAYER.match(megatron_name)
    if match:
        layer, suffix = match.groups()
        return tuple(f"model.layers.{layer}.{s}" for s in _LAYER_TABLE[suffix][0])
    if megatron_name == "output_layer.weight" and arch.tie_word_embeddings:
        return ("model.embed_tokens.weight",)
    return (_GLOBAL_TABLE[megatron_name][0],)


def tp_split(megatron_name: str) -> TPSplit:
    match = _LAYER.match(megatron_name)
    if match:
        return _LAYER_TABLE[match.group(2)][1]
    return _GLOBAL_TABLE[megatron_name][1]


# ----------------------------------------------------------------------------- fused tensors


def fuse_qkv(arch: PolicyArchitecture, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Megatron's fused QKV: for each query group, its query heads, then its key, then its value."""
    groups, hpg, hd = arch.num_kv_heads, arch.heads_per_group, arch.head_dim
    trailing = q.shape[1:]
    q = q.reshape(groups, hpg * hd, *trailing)
    k = k.reshape(groups, hd, *trailing)
    v = v.reshape(groups, hd, *trailing)
    return torch.cat([q, k, v], dim=1).reshape(groups * (hpg + 2) * hd, *trailing)


def split_qkv(arch: PolicyArchitecture, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``fuse_qkv``."""
    groups, hpg, hd = arch.num_kv_heads, arch.heads_per_group, arch.head_dim
    trailing = qkv.shape[1:]
    grouped = qkv.reshape(groups, (hpg + 2) * hd, *trailing)
    q, k, v = torch.split(grouped, [hpg * hd, hd, hd], dim=1)
    return (q.reshape(-1, *trailing), k.reshape(-1, *trailing), v.reshape(-1, *trailing))


def _pad_vocab(tensor: torch.Tensor, padded_vocab_size: int) -> torch.Tensor:
    extra = padded_vocab_size - tensor.shape[0]
    if extra < 0:
        raise ValueError(f"vocabulary of {tensor.shape[0]} rows does not fit padded size {padded_vocab_size}")
    if extra == 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(extra, *tensor.shape[1:])])


# ----------------------------------------------------------------------------- HF <-> Megatron full


def to_megatron_full(arch: PolicyArchitecture, megatron_name: str, get_hf: TensorGetter,
                     padded_vocab_size: int) -> torch.Tensor:
    """Build one Megatron-full tensor from the HF tensors it is made of."""
    sources = [get_hf(name) for name in hf_sources(arch, megatron_name)]
    if megatron_name.endswith("linear_qkv.weight") or megatron_name.endswith("linear_qkv.bias"):
        return fuse_qkv(arch, *sources)
    if megatron_name.endswith("linear_fc1.weight"):
        return torch.cat(sources, dim=0)
    (tensor,) = sources
    if megatron_name in _VOCAB_PADDED:
        return _pad_vocab(tensor, padded_vocab_size)
    return tensor


def to_hf(arch: PolicyArchitecture, megatron_name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors held in one Megatron-full tensor (padding removed)."""
    sources = hf_sources(arch, megatron_name)
    if megatron_name.endswith("linear_qkv.weight") or megatron_name.endswith("linear_qkv.bias"):
        yield from zip(sources, split_qkv(arch, tensor))
    elif megatron_name.endswith("linear_fc1.weight"):
        yield from zip(sources, torch.chunk(tensor, 2, dim=0))
    elif megatron_name in _VOCAB_PADDED:
        yield sources[0], tensor[: arch.vocab_size]
    else:
        yield sources[0], tensor


# ----------------------------------------------------------------------------- TP / PP placement


def shard_for_tp(megatron_name: str, tensor: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's slice of a Megatron-full tensor."""
    split = tp_split(megatron_name)
    if split is TPSplit.REPLICATED or tp_size == 1:
        return tensor
    if split is TPSplit.ROWS:
        return torch.chunk(tensor, tp_size, dim=0)[tp_rank]
    if split is TPSplit.COLUMNS:
        return torch.chunk(tensor, tp_size, dim=1)[tp_rank]
    gate, up = torch.chunk(tensor, 2, dim=0)
    return torch.cat([torch.chunk(gate, tp_size, dim=0)[tp_rank], torch.chunk(up, tp_size, dim=0)[tp_rank]])


def merge_tp_shards(megatron_name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of ``shard_for_tp``: the Megatron-full tensor from every TP rank's slice, in rank order."""
    split = tp_split(megatron_name)
    if split is TPSplit.REPLICATED or len(shards) == 1:
        return shards[0]
    if split is TPSplit.ROWS:
        return torch.cat(shards, dim=0)
    if split is TPSplit.COLUMNS:
        return torch.cat(shards, dim=1)
    halves = [torch.chunk(s, 2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


def global_name(local_name: str, pp_rank: int, layers_per_stage: int) -> str:
    """Megatron-full name of a tensor as named inside pipeline stage ``pp_rank``."""
    match = _LAYER.match(local_name)
    if not match:
        return local_name
    return f"decoder.layers.{int(match.group(1)) + pp_rank * layers_per_stage}.{match.group(2)}"


def local_name(full_name: str, pp_rank: int, layers_per_stage: int) -> str:
    """Inverse of ``global_name`` for a layer that lives on stage ``pp_rank``."""
    match = _LAYER.match(full_name)
    if not match:
        return full_name
    return f"decoder.layers.{int(match.group(1)) - pp_rank * layers_per_stage}.{match.group(2)}"


def megatron_full_shape(arch: PolicyArchitecture, megatron_name: str, padded_vocab_size: int) -> tuple[int, ...]:
    """Shape of a Megatron-full tensor, known without holding it (for receive buffers)."""
    hidden, hd = arch.hidden_size, arch.head_dim
    qkv_rows = (arch.num_attention_heads + 2 * arch.num_kv_heads) * hd
    if megatron_name in _VOCAB_PADDED:
        return (padded_vocab_size, hidden)
    suffix = _LAYER.match(megatron_name).group(2) if _LAYER.match(megatron_name) else megatron_name
    shapes = {
        "decoder.final_layernorm.weight": (hidden,),
        "input_layernorm.weight": (hidden,),
        "pre_mlp_layernorm.weight": (hidden,),
        "self_attention.linear_qkv.weight": (qkv_rows, hidden),
        "self_attention.linear_qkv.bias": (qkv_rows,),
        "self_attention.linear_proj.weight": (hidden, arch.num_attention_heads * hd),
        "mlp.linear_fc1.weight": (2 * arch.intermediate_size, hidden),
        "mlp.linear_fc2.weight": (hidden, arch.intermediate_size),
    }
    return shapes[suffix]


def owning_stage(arch: PolicyArchitecture, megatron_name: str, pp_size: int) -> int:
    """The pipeline stage that holds a Megatron-full tensor (the embedding: the first)."""
    match = _LAYER.match(megatron_name)
    if match:
        return int(match.group(1)) // (arch.num_layers // pp_size)
    return 0 if megatron_name == "embedding.word_embeddings.weight" else pp_size - 1
