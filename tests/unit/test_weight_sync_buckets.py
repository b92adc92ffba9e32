import math

from megatron_tlt.formats import weights
from megatron_tlt.formats.architecture import architecture_from_dict
from tiny_models import TINY_LLAMA_ROLLOUT, TINY_QWEN2
from megatron_tlt.rl.weight_sync import _plan_buckets


def test_buckets_cover_every_tensor_once_in_order_within_one_stage_and_the_size_bound():
    for config in (TINY_LLAMA_ROLLOUT, TINY_QWEN2):
        arch = architecture_from_dict(config)
        bound = 200_000
        buckets = _plan_buckets(arch, pp_size=2, padded_vocab_size=256, element_size=4, bucket_bytes=bound)
        assert [n for b in buckets for n in b.names] == weights.megatron_names(arch)
        for bucket in buckets:
            assert {weights.owning_stage(arch, n, 2) for n in bucket.names} == {bucket.stage}
            sizes = [math.prod(weights.megatron_full_shape(arch, n, 256)) * 4 for n in bucket.names]
            assert sum(sizes) <= bound or len(sizes) == 1  # a tensor larger than the bound travels alone


def test_embedding_lives_on_the_first_stage_and_head_and_final_norm_on_the_last():
    arch = architecture_from_dict(TINY_LLAMA_ROLLOUT)
    assert weights.owning_stage(arch, "embedding.word_embeddings.weight", 2) == 0
    assert weights.owning_stage(arch, "decoder.layers.1.mlp.linear_fc1.weight", 2) == 0
    assert weights.owning_stage(arch, "decoder.layers.2.mlp.linear_fc1.weight", 2) == 1
    assert weights.owning_stage(arch, "output_layer.weight", 2) == 1
    assert weights.owning_stage(arch, "decoder.final_layernorm.weight", 2) == 1
