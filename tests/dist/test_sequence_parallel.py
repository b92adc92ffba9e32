"""Sequence parallelism changes how the policy runs, not what it computes: at TP=2 the log-prob pass (log-probs
and the drafter's captured features), the logits, one policy update and one warm-up step give the same results
with it as without, on one checkpoint. In both layouts an on-policy update (no log-prob pass: its own forward
gives the old log-probs and the drafter features) matches the same update after a log-prob pass.

Token counts are chosen so that padding is exercised: with sequence parallelism the model input (all tokens but
the last) must split over the 2 TP ranks, so a micro-batch whose longest sequence has an even token count gets
one more pad position, which causal attention and the loss masks must hide.
"""

import pytest
import torch

from megatron_tlt.launcher import run_on_ranks

# micro-batches of 3 (log-prob pass): longest 8 tokens (padded to 9) and 5 (no padding)
SEQUENCES = [[1, 5, 7, 9, 11, 13], [3, 4, 100], [200, 13, 17, 19, 23, 29, 31, 37], [42, 43], [7, 8, 9, 10, 11]]
BOUNDED_ROWS = 5  # a drafter buffer this size keeps the last two sequences: no feature rows in the first batch
PROMPT_LEN = 2
LOGIT_IDS = [[3, 4, 100, 7, 9, 11, 13], [5, 6, 7, 8, 9, 10, 11]]  # 7 ids: padded to 8


def _one_layout(ckpt_dir: str, sequence_parallel: bool) -> dict:
    """Everything the RL paths compute with one policy, built with or without sequence parallelism."""
    from megatron_tlt.config import AlgorithmConfig
    from megatron_tlt.model import mcore, policy
    from megatron_tlt.model.build_options import BuildOptions
    from megatron_tlt.rl.actor import compute_logprobs
    from megatron_tlt.rl.tiny.warmup import WarmupSchedule, run_warmup
    from megatron_tlt.rl.update import PolicySequence, policy_update_step

    model, meta = policy.load_policy_checkpoint(ckpt_dir, options=BuildOptions(sequence_parallel=sequence_parallel),
                                                per_token_loss=True)
    assert mcore.unwrap(model).config.sequence_parallel is sequence_parallel
    ddp = mcore.wrap_ddp(model)
    optimizer = mcore.build_optimizer(ddp, lr=1e-3)
    vocab = meta.arch.vocab_size
    out = {}
    full = compute_logprobs(ddp, SEQUENCES, vocab_size=vocab, micro_batch_size=3, capture_hidden=True)
    bounded = compute_logprobs(ddp, SEQUENCES, vocab_size=vocab, micro_batch_size=3, capture_hidden=True,
                               max_feature_rows=BOUNDED_ROWS)
    out["logprobs"], out["features"] = full.token_logprobs, full.features
    out["bounded"] = (bounded.feature_indices, bounded.features)
    out["logits"] = policy.forward_logits(ddp, torch.tensor(LOGIT_IDS), vocab)
    out["greedy"] = policy.greedy_generate(ddp, SEQUENCES[0], 3, vocab)
    # off-policy and with a KL term, so every term of the loss is non-trivial
    sequences = [PolicySequence(token_ids=seq, prompt_len=PROMPT_LEN, old_logprobs=lp + 0.05 * (i % 3),
                                advantage=1.0 - 0.5 * i, ref_logprobs=lp - 0.1)
                 for i, (seq, lp) in enumerate(zip(SEQUENCES, full.token_logprobs))]
    settings = AlgorithmConfig(clip_low=0.2, clip_high=0.28, loss_aggregation="token_mean", kl_coef=0.1)
    out["update"] = policy_update_step(ddp, optimizer, sequences, vocab_size=vocab, micro_batch_size=2, pad_id=0,
                                       settings=settings).metrics
    out["after_update"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    corpus = [(seq, PROMPT_LEN) for seq in SEQUENCES]
    schedule = WarmupSchedule(steps=1, sequences_per_step=4, micro_batch_size=2, lr=1e-3, seed=0)
    out["warmup"] = run_warmup(ddp, optimizer, corpus, schedule, vocab_size=vocab, pad_id=0, dp_rank=0, dp_size=1)
    out["after_warmup"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["unpadded_refused"] = _unpadded_batch_refusal(ddp, optimizer, vocab)
    return out


def _on_policy_and_after_a_log_prob_pass(ckpt_dir: str, sequence_parallel: bool) -> dict[bool, dict]:
    """One GRPO update from the checkpoint, capturing the drafter features: with the old log-probs of a log-prob
    pass (False) and on-policy, from the update's own forward (True)."""
    from megatron_tlt.config import AlgorithmConfig
    from megatron_tlt.model import mcore, policy
    from megatron_tlt.model.build_options import BuildOptions
    from megatron_tlt.rl.actor import compute_logprobs
    from megatron_tlt.rl.update import PolicySequence, policy_update_step

    out = {}
    for on_policy in (False, True):
        model, meta = policy.load_policy_checkpoint(
            ckpt_dir, options=BuildOptions(sequence_parallel=sequence_parallel), per_token_loss=True)
        ddp = mcore.wrap_ddp(model)
        optimizer = mcore.build_optimizer(ddp, lr=1e-3)
        vocab = meta.arch.vocab_size
        passed = compute_logprobs(ddp, SEQUENCES, vocab_size=vocab, micro_batch_size=3, capture_hidden=True)
        sequences = [PolicySequence(token_ids=seq, prompt_len=PROMPT_LEN, old_logprobs=None if on_policy else lp,
                                    advantage=1.0 - 0.5 * i) for i, (seq, lp) in enumerate(zip(SEQUENCES,
                                                                                             passed.token_logprobs))]
        result = policy_update_step(ddp, optimizer, sequences, vocab_size=vocab, micro_batch_size=2, pad_id=0,
                                    settings=AlgorithmConfig(), capture_features=True, max_feature_rows=BOUNDED_ROWS)
        out[on_policy] = {"metrics": result.metrics, "kept": result.features.feature_indices,
                          "features": result.features.features, "pass_features": passed.features,
                          "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    return out


def _unpadded_batch_refusal(model, optimizer, vocab_size: int) -> str | None:
    """What ``lm_train_step`` says to a batch whose model input (3 tokens) does not split over 2 TP ranks."""
    from megatron_tlt.model.lm_training import LMMicroBatch, lm_train_step

    tokens_bs = torch.ones(1, 4, dtype=torch.long)
    try:
        lm_train_step(model, optimizer, [LMMicroBatch(tokens_bs=tokens_bs, loss_mask_bs=tokens_bs)],
                      vocab_size=vocab_size)
    except ValueError as err:
        return str(err)
    return None


def _with_and_without_on_rank(ckpt_dir: str) -> dict[bool, dict]:
    from megatron_tlt.parallel import ParallelLayout

    with ParallelLayout(tensor_parallel_size=2):
        return {sp: _one_layout(ckpt_dir, sp) | {"on_policy": _on_policy_and_after_a_log_prob_pass(ckpt_dir, sp)}
                for sp in (False, True)}


def _assert_close(ours, ref, what):
    assert ours.shape == ref.shape, what
    assert (ours - ref).abs().max() < 1e-5, what


@pytest.fixture(scope="module")
def per_rank(llama_mcore_tp2):
    return run_on_ranks(_with_and_without_on_rank, 2, str(llama_mcore_tp2))


def test_log_probs_features_and_logits_are_the_same_with_sequence_parallelism(per_rank):
    for plain, sp in ((r[False], r[True]) for r in per_rank.values()):
        for ours, ref, seq in zip(sp["logprobs"], plain["logprobs"], SEQUENCES):
            assert ours.shape == (len(seq) - 1,)
            _assert_close(ours, ref, "log-probs")
        assert sp["features"].shape == (sum(len(s) - 1 for s in SEQUENCES), 64)
        _assert_close(sp["features"], plain["features"], "features")
        assert sp["bounded"][0] == plain["bounded"][0] == [3, 4]
        _assert_close(sp["bounded"][1], plain["bounded"][1], "bounded features")
        _assert_close(sp["bounded"][1], sp["features"][-BOUNDED_ROWS:], "bounded features are the last rows")
        assert sp["logits"].shape == (2, 7, 250)
        _assert_close(sp["logits"], plain["logits"], "logits")
        assert sp["greedy"] == plain["greedy"]


def test_one_update_and_one_warm_up_step_are_the_same_with_sequence_parallelism(per_rank):
    for plain, sp in ((r[False], r[True]) for r in per_rank.values()):
        assert sp["update"].keys() == plain["update"].keys()
        for name, value in plain["update"].items():
            assert sp["update"][name] == pytest.approx(value, abs=1e-5), name
        assert plain["update"]["num_tokens"] == sum(len(s) - PROMPT_LEN for s in SEQUENCES)
        assert plain["update"]["ratio_mean"] != pytest.approx(1.0, abs=1e-3)  # off-policy: the clip term works
        assert sp["warmup"] == pytest.approx(plain["warmup"], abs=1e-5)
        for stage in ("after_update", "after_warmup"):
            for name, ref in plain[stage].items():
                _assert_close(sp[stage][name], ref, f"{stage}: {name}")


def test_an_on_policy_update_matches_the_update_after_a_log_prob_pass_and_keeps_the_same_features(per_rank):
    for layouts in per_rank.values():
        for layout in layouts.values():
            after_pass, on_policy = layout["on_policy"][False], layout["on_policy"][True]
            assert on_policy["metrics"]["ratio_mean"] == 1.0 and on_policy["metrics"]["approx_kl"] == 0.0
            assert on_policy["metrics"]["pg_loss"] == pytest.approx(after_pass["metrics"]["pg_loss"], abs=1e-5)
            for name, ref in after_pass["params"].items():
                _assert_close(on_policy["params"][name], ref, f"after the update: {name}")
            # the update's forward keeps what the buffer would: the last two sequences, as the log-prob pass does
            assert on_policy["kept"] == after_pass["kept"] == [3, 4]
            _assert_close(on_policy["features"], after_pass["pass_features"][-BOUNDED_ROWS:], "features")
            _assert_close(on_policy["features"], after_pass["features"], "features")


def test_a_batch_not_padded_for_sequence_parallelism_is_refused_with_the_fix(per_rank):
    for ranks in per_rank.values():
        assert ranks[False]["unpadded_refused"] is None
        assert "multiple of 2 (pad with lm_training.token_width); got [4]" in ranks[True]["unpadded_refused"]
