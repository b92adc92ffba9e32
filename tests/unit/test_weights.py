import pytest
import torch
from safetensors.torch import load_file

from megatron_tlt.formats import weights
from megatron_tlt.formats.architecture import architecture_from_dict
from tiny_models import TINY_LLAMA, TINY_QWEN2


def test_fused_qkv_groups_each_kv_head_with_its_query_heads():
    arch = architecture_from_dict(TINY_LLAMA)  # 8 query heads, 4 kv groups, head_dim 8
    hd, hidden = arch.head_dim, arch.hidden_size
    q = torch.arange(8 * hd).float().repeat_interleave(hidden).reshape(8 * hd, hidden)
    k = -torch.arange(1, 4 * hd + 1).float().repeat_interleave(hidden).reshape(4 * hd, hidden)
    v = 1000 + torch.arange(4 * hd).float().repeat_interleave(hidden).reshape(4 * hd, hidden)
    qkv = weights.fuse_qkv(arch, q, k, v)
    group0 = qkv[: 4 * hd]  # 2 query heads, then 1 key head, then 1 value head
    assert torch.equal(group0[: 2 * hd], q[: 2 * hd])
    assert torch.equal(group0[2 * hd : 3 * hd], k[:hd])
    assert torch.equal(group0[3 * hd :], v[:hd])
    assert all(torch.equal(a, b) for a, b in zip(weights.split_qkv(arch, qkv), (q, k, v)))


@pytest.mark.parametrize("config", [TINY_LLAMA, TINY_QWEN2], ids=["llama", "qwen2"])
def test_tp_shards_merge_back_to_the_full_tensor(config):
    arch = architecture_from_dict(config)
    torch.manual_seed(0)
    for name in weights.megatron_names(arch):
        full = torch.randn(256, 64) if "embedding" in name or "output_layer" in name else torch.randn(64, 32)
        if "linear_fc1" in name:
            full = torch.randn(2 * 160, 64)
        for tp in (1, 2, 4):
            shards = [weights.shard_for_tp(name, full, r, tp) for r in range(tp)]
            assert torch.equal(weights.merge_tp_shards(name, shards), full), (name, tp)


def test_gate_up_shard_holds_its_slice_of_gate_then_its_slice_of_up():
    gate, up = torch.zeros(4, 2), torch.ones(4, 2)
    shard = weights.shard_for_tp("decoder.layers.0.mlp.linear_fc1.weight", torch.cat([gate, up]), 1, 2)
    assert torch.equal(shard, torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]))


def test_pipeline_stage_names_map_to_global_layer_numbers_and_back():
    name = weights.global_name("decoder.layers.1.mlp.linear_fc2.weight", pp_rank=1, layers_per_stage=2)
    assert name == "decoder.layers.3.mlp.linear_fc2.weight"
    assert weights.local_name(name, pp_rank=1, layers_per_stage=2) == "decoder.layers.1.mlp.linear_fc2.weight"
    assert weights.global_name("output_layer.weight", 1, 2) == "output_layer.weight"


def test_name_tables_cover_exactly_the_tensors_transformers_saves(tiny_llama_dir, tiny_qwen2_dir):
    from megatron_tlt.formats.hf_io import HFCheckpointReader

    for config, model_dir in ((TINY_LLAMA, tiny_llama_dir), (TINY_QWEN2, tiny_qwen2_dir)):
        arch = architecture_from_dict(config)
        assert sorted(weights.hf_names(arch)) == sorted(HFCheckpointReader(model_dir).names())


def test_hf_to_megatron_full_and_back_is_exact_with_vocab_padding(tiny_llama_dir):
    arch = architecture_from_dict(TINY_LLAMA)
    hf = load_file(str(tiny_llama_dir / "model.safetensors"))
    back = {}
    for name in weights.megatron_names(arch):
        full = weights.to_megatron_full(arch, name, hf.__getitem__, padded_vocab_size=256)
        if name == "embedding.word_embeddings.weight":
            assert full.shape[0] == 256 and torch.count_nonzero(full[250:]) == 0
        back.update(weights.to_hf(arch, name, full))
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
