"""The Megatron log-prob pass against transformers: log-probs of ragged sequences, and the captured
post-final-norm hidden states (the EAGLE drafter's features), at TP=1, TP=2 and PP=2."""

import pytest

from megatron_tlt.launcher import run_on_ranks
from tiny_models import hf_logprobs_and_features

SEQUENCES = [[1, 5, 7, 9, 11, 13], [3, 4, 100], [200, 13, 17, 19, 23, 29, 31, 37], [42, 43]]
SHARED_ROWS = 10  # a drafter buffer this size keeps the newest three sequences (2 + 7 + 1 rows), not the first (5)


def _logprobs_on_rank(ckpt_dir: str, tp: int, pp: int):
    from megatron_tlt.model import policy
    from megatron_tlt.parallel import ParallelLayout
    from megatron_tlt.rl.actor import compute_logprobs, features_on_every_stage

    with ParallelLayout(tensor_parallel_size=tp, pipeline_parallel_size=pp):
        model, meta = policy.load_policy_checkpoint(ckpt_dir)
        result = compute_logprobs(model, SEQUENCES, vocab_size=meta.arch.vocab_size, micro_batch_size=3,
                                  capture_hidden=True)
        # what the trainer does: capture only what the drafter buffer keeps, then share it over the stages
        bounded = compute_logprobs(model, SEQUENCES, vocab_size=meta.arch.vocab_size, micro_batch_size=3,
                                   capture_hidden=True, max_feature_rows=SHARED_ROWS)
        shared = features_on_every_stage(model, SEQUENCES, bounded)
        held = None if bounded.features is None else bounded.features.shape
        return result.token_logprobs, result.hidden_states, shared, held


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
def test_logprobs_and_drafter_features_match_transformers(tp, pp, llama_mcore_tp2, tiny_llama_dir):
    per_rank = run_on_ranks(_logprobs_on_rank, tp * pp, str(llama_mcore_tp2), tp, pp)
    ref_logprobs, ref_hidden = hf_logprobs_and_features(tiny_llama_dir, SEQUENCES)
    last_stage = [v for v in per_rank.values() if v[0]]
    assert len(last_stage) == tp  # every TP rank of the last stage holds the full result
    for _, _, (kept, shared), held in per_rank.values():  # every stage, for the drafter's idle ranks
        assert kept == SEQUENCES[1:]
        # the last stage never held more than the buffer's rows (here exactly the three kept sequences)
        assert held is None or held == (SHARED_ROWS, shared[0].shape[1])
        for ours, seq in zip(shared, kept):
            ref = ref_hidden[SEQUENCES.index(seq)]
            assert ours.shape == ref.shape and (ours - ref).abs().max() < 1e-4
    for logprobs, hidden, _, _ in last_stage:
        for ours, ref, seq in zip(logprobs, ref_logprobs, SEQUENCES):
            assert ours.shape == (len(seq) - 1,)
            assert (ours - ref).abs().max() < 1e-4
        for ours, ref in zip(hidden, ref_hidden):
            assert ours.shape == ref.shape and (ours - ref).abs().max() < 1e-4
