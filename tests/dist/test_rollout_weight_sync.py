"""After a weight sync from Megatron, the vLLM engines continue prompts exactly as Megatron does.

Engines are colocated (vLLM external_launcher, in-process, gloo): one per rank, or one over a
tensor-parallel group of ranks, each holding half of it. They start from dummy weights, so only the
sync can make them agree with the policy.
"""

import pytest

from megatron_tlt.formats.hf_io import HFCheckpointReader
from megatron_tlt.launcher import run_on_ranks

# The last prompt is longer than a KV-cache block (16 on GPU, 128 on CPU): its first block is
# cached by the pre-sync generation and must not be reused after the weights change.
PROMPTS = [[1, 5, 7, 9], [3, 4, 100, 22, 17], [200, 13], [(7 * i) % 250 + 1 for i in range(150)]]
NEW_TOKENS = 16


def _sync_and_compare_on_rank(ckpt_dir: str, tp: int, pp: int, workdir: str, eagle: bool = False, engine_tp: int = 1):
    from megatron_tlt.model import policy
    from tiny_models import next_token_fixture
    from megatron_tlt.parallel import ParallelLayout
    from megatron_tlt.rl.weight_sync import sync_policy_to_engine
    from megatron_tlt.spec.engine import RolloutEngine, RolloutEngineConfig, SamplingSettings, SpeculativeSettings

    with ParallelLayout(tensor_parallel_size=tp, pipeline_parallel_size=pp) as layout:
        model, meta = policy.load_policy_checkpoint(ckpt_dir)
        megatron_greedy = [policy.greedy_generate(model, p, NEW_TOKENS, meta.arch.vocab_size) for p in PROMPTS]
        speculation = {}
        if eagle:  # a drafter that knows nothing of this policy: speculation may only cost speed
            speculation = dict(speculative=SpeculativeSettings(num_speculative_tokens=3),
                               drafter=next_token_fixture(meta.arch)["good_drafter"])
        engine = RolloutEngine(meta.arch, RolloutEngineConfig(max_model_len=256, tensor_parallel_size=engine_tp),
                               workdir=workdir, rank=layout.rank, **speculation)
        try:
            before = engine.generate(PROMPTS, SamplingSettings(temperature=0.0, max_tokens=NEW_TOKENS))
            stats = sync_policy_to_engine(model, meta.arch, engine, padded_vocab_size=meta.padded_vocab_size,
                                          bucket_bytes=256 * 1024)
            after = engine.generate(PROMPTS, SamplingSettings(temperature=0.0, max_tokens=NEW_TOKENS))
        finally:
            engine.close()
        # closing the engine must leave the process group, and so Megatron, working
        after_close = policy.greedy_generate(model, PROMPTS[0], 4, meta.arch.vocab_size)
        return {
            "step_batch_sizes": after.step_batch_sizes,
            "step_seconds": after.step_seconds,
            "drafts": after.spec.num_drafts,
            "after_close": after_close,
            "megatron": megatron_greedy,
            "before": [r[0] for r in before.token_ids],
            "after": [r[0] for r in after.token_ids],
            "bytes": stats.num_bytes,
            "buckets": stats.num_buckets,
        }


@pytest.mark.parametrize("tp, pp, engine_tp", [(1, 1, 1), (2, 1, 1), (1, 2, 1)], ids=["tp1", "tp2", "pp2"])
def test_vllm_greedy_equals_megatron_greedy_after_sync(tp, pp, engine_tp, rollout_llama_mcore, rollout_llama_dir,
                                                       tmp_path):
    hf = HFCheckpointReader(rollout_llama_dir)
    hf_bytes = sum(hf.get(n).numel() * hf.get(n).element_size() for n in hf.names())
    per_rank = run_on_ranks(_sync_and_compare_on_rank, tp * pp, str(rollout_llama_mcore), tp, pp, str(tmp_path),
                            False, engine_tp)
    assert len(per_rank) == tp * pp
    for result in per_rank.values():
        assert result["before"] != result["megatron"]  # dummy weights: the sync is what makes them agree
        assert result["after"] == result["megatron"]
        assert result["after_close"] == result["megatron"][0][:4]
        # per engine step: all prompts in flight, then none left once every response is complete
        assert result["step_batch_sizes"][0] == len(PROMPTS) and len(result["step_batch_sizes"]) >= NEW_TOKENS
        assert len(result["step_seconds"]) == len(result["step_batch_sizes"]) and min(result["step_seconds"]) > 0
        assert all(len(tokens) == NEW_TOKENS for tokens in result["after"])
        # every HF tensor arrives once (fp32, vocabulary padding removed), in several bounded buckets
        assert result["bytes"] == hf_bytes and result["buckets"] > 4


@pytest.mark.parametrize("tp", [1, 2], ids=["engine-tp1", "engine-tp2"])
def test_greedy_output_with_eagle_on_equals_megatron_greedy(tp, rollout_llama_mcore, tmp_path):
    """At TP=2 one engine spans both ranks (half of the policy and of the drafter on each)."""
    per_rank = run_on_ranks(_sync_and_compare_on_rank, tp, str(rollout_llama_mcore), tp, 1, str(tmp_path), True, tp,
                            isolated=True)
    assert len(per_rank) == tp
    for result in per_rank.values():
        assert result["drafts"] > 0  # speculation really ran
        assert result["before"] != result["megatron"] and result["after"] == result["megatron"]
        assert result["step_batch_sizes"][0] == len(PROMPTS)
