import math

import pytest
import torch

from megatron_tlt.drafter.loss import drafter_loss
from megatron_tlt.drafter.model import EagleDrafter
from megatron_tlt.drafter.packing import eagle_examples, pack_sequences
from megatron_tlt.formats.architecture import architecture_from_dict
from tiny_models import TINY_LLAMA, next_token_fixture

LLAMA = architecture_from_dict(TINY_LLAMA)


def _fixture_features(fixture, tokens):
    """f_t of the next-token target: its residual stream is the embedding, so f_t = rmsnorm(embed(x_t))."""
    e = fixture["target"]["model.embed_tokens.weight"][tokens]
    return e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + LLAMA.rms_norm_eps)


def _fixture_sequences(fixture, num_sequences, num_tokens, seed):
    g = torch.Generator().manual_seed(seed)
    sequences = []
    for _ in range(num_sequences):
        tokens = torch.randint(0, LLAMA.vocab_size, (num_tokens,), generator=g)
        sequences.append((tokens, _fixture_features(fixture, tokens[:-1])))  # rows 0 .. L-2, as the log-prob pass
    return sequences


def _pack_loss(drafter, fixture, pack):
    embed, lm_head = fixture["target"]["model.embed_tokens.weight"], fixture["target"]["lm_head.weight"]
    pred = drafter(embed[pack.input_ids_t], pack.features_th, pack.position_ids_t, pack.segment_ids_t)
    return drafter_loss(pred, pack.target_features_th, lm_head)


def test_loss_matches_a_hand_computed_example():
    pred = torch.tensor([[1.0, 0.0], [0.0, 2.0]], requires_grad=True)
    target = torch.tensor([[0.0, 3.0], [0.0, 1.0]])
    lm_head = torch.eye(2, requires_grad=True)
    loss, metrics = drafter_loss(pred, target, lm_head, hidden_weight=2.0, ce_weight=0.5)
    # SmoothL1 (beta 1) per element: |1| -> 0.5, |3| -> 2.5, 0 -> 0, |1| -> 0.5; mean 0.875
    hidden = 0.875

    def soft_ce(target_logits, pred_logits):
        p = [math.exp(v) / sum(math.exp(u) for u in target_logits) for v in target_logits]
        log_z = math.log(sum(math.exp(u) for u in pred_logits))
        return -sum(pi * (v - log_z) for pi, v in zip(p, pred_logits))

    ce = (soft_ce([0.0, 3.0], [1.0, 0.0]) + soft_ce([0.0, 1.0], [0.0, 2.0])) / 2
    assert metrics["hidden_loss"].item() == pytest.approx(hidden)
    assert metrics["ce_loss"].item() == pytest.approx(ce)
    assert loss.item() == pytest.approx(2.0 * hidden + 0.5 * ce)
    assert metrics["top1_agreement"].item() == 0.5  # row 0: 0 vs 1; row 1: 1 vs 1
    loss.backward()
    assert pred.grad is not None and lm_head.grad is None, "the policy's LM head is frozen"


def test_default_weights_are_one_for_hidden_states_and_a_tenth_for_cross_entropy():
    pred, target = torch.randn(5, 4), torch.randn(5, 4)
    lm_head = torch.randn(7, 4)
    loss, metrics = drafter_loss(pred, target, lm_head)
    assert loss.item() == pytest.approx(metrics["hidden_loss"].item() + 0.1 * metrics["ce_loss"].item())


def test_the_tv_term_is_one_minus_a_sampled_drafts_acceptance_and_weighs_in_only_when_asked():
    pred = torch.tensor([[1.0, 0.0], [0.0, 2.0]], requires_grad=True)
    target = torch.tensor([[0.0, 3.0], [0.0, 1.0]])
    lm_head = torch.eye(2)

    def acceptance(target_logits, pred_logits):  # a draft drawn from q is kept with probability sum_v min(p, q)
        p, q = torch.softmax(torch.tensor(target_logits), 0), torch.softmax(torch.tensor(pred_logits), 0)
        return float(torch.minimum(p, q).sum())

    tv = 1 - (acceptance([0.0, 3.0], [1.0, 0.0]) + acceptance([0.0, 1.0], [0.0, 2.0])) / 2
    plain, plain_metrics = drafter_loss(pred, target, lm_head)
    assert "tv_distance" not in plain_metrics  # not computed unless it weighs in
    weighted, metrics = drafter_loss(pred, target, lm_head, tv_weight=2.0)
    assert metrics["tv_distance"].item() == pytest.approx(tv)
    assert weighted.item() == pytest.approx(plain.item() + 2.0 * tv)
    (grad_tv,) = torch.autograd.grad(weighted - plain, pred)
    assert grad_tv.abs().sum() > 0  # the tv term trains the drafter


def test_eagle_pairing_makes_the_vllm_accepted_drafter_agree_everywhere_and_the_shifted_one_does_not():
    """The drafter vLLM accepts at every greedy step must score perfectly under our pairing.

    Correct: input (x_{t+1}, f_t), target f_{t+1}. Shifted (the published online trainer's apparent
    pairing): input (x_t, f_t), same target: the same drafter then drafts the token one step behind.
    """
    fixture = next_token_fixture(LLAMA)
    drafter = EagleDrafter.from_tensors(LLAMA, fixture["good_drafter"])
    tokens, features = _fixture_sequences(fixture, 1, 50, seed=0)[0]
    (pack,) = pack_sequences([(tokens, features)], max_tokens=64)
    with torch.no_grad():
        loss, metrics = _pack_loss(drafter, fixture, pack)
        examples = eagle_examples(tokens, features)
        shifted_ids = tokens[: examples.num_tokens]  # x_t instead of x_{t+1}
        shifted = drafter(fixture["target"]["model.embed_tokens.weight"][shifted_ids], examples.features_th,
                          examples.position_ids_t, torch.zeros_like(shifted_ids))
        lm_head = fixture["target"]["lm_head.weight"]
        shifted_loss, shifted_metrics = drafter_loss(shifted, examples.target_features_th, lm_head)
    assert metrics["top1_agreement"].item() == 1.0
    assert shifted_metrics["top1_agreement"].item() < 0.2
    assert loss.item() < shifted_loss.item()


def test_adam_on_next_token_target_features_raises_top1_agreement_far_above_chance():
    """Fresh sequences every step, as rollouts keep arriving in RL (a fixed small set is memorised instead)."""
    torch.manual_seed(0)
    fixture = next_token_fixture(LLAMA)
    (held_out,) = pack_sequences(_fixture_sequences(fixture, 4, 65, seed=10_000), max_tokens=512)
    drafter = EagleDrafter(LLAMA, seed=0)
    with torch.no_grad():
        _, before = _pack_loss(drafter, fixture, held_out)
    optimizer = torch.optim.Adam(drafter.parameters(), lr=1e-2)
    for step in range(200):
        (pack,) = pack_sequences(_fixture_sequences(fixture, 4, 33, seed=step), max_tokens=512)
        loss, _ = _pack_loss(drafter, fixture, pack)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        _, after = _pack_loss(drafter, fixture, held_out)
    assert before["top1_agreement"].item() < 0.1  # chance is ~1 / 250
    assert after["top1_agreement"].item() > 0.6  # ~0.8 measured
