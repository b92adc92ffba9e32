import math

import pytest
import torch

from megatron_tlt.rl.losses import (
    aggregate_loss,
    aggregate_parts,
    policy_token_terms,
    kl_penalty,
    policy_loss_with_kl,
    ppo_clip_policy_loss,
)

LN2 = math.log(2.0)


def _one_token(ratio: float, advantage: float, *, clip_low: float = 0.2, clip_high: float = 0.2):
    """Loss, metrics and d loss / d logprob for a single token with the given ratio and advantage."""
    logprobs_bt = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, metrics = ppo_clip_policy_loss(
        logprobs_bt, torch.zeros(1, 1), torch.tensor([[advantage]]), torch.ones(1, 1),
        clip_low=clip_low, clip_high=clip_high,
    )
    loss.backward()
    return loss.item(), metrics, logprobs_bt.grad.item()


def test_ratio_above_one_plus_clip_high_with_positive_advantage_is_clipped():
    # loss = max(-1 * 1.5, -1 * clamp(1.5, .8, 1.2)) = max(-1.5, -1.2) = -1.2, constant -> no gradient
    loss, metrics, grad = _one_token(1.5, +1.0)
    assert loss == pytest.approx(-1.2)
    assert grad == 0.0
    assert metrics["clip_fraction"].item() == 1.0
    assert metrics["clip_fraction_high"].item() == 1.0 and metrics["clip_fraction_low"].item() == 0.0


def test_ratio_above_one_plus_clip_high_with_negative_advantage_is_not_clipped():
    # loss = max(+1.5, +1.2) = 1.5 = ratio -> d loss / d logprob = ratio = 1.5
    loss, metrics, grad = _one_token(1.5, -1.0)
    assert loss == pytest.approx(1.5)
    assert grad == pytest.approx(1.5)
    assert metrics["clip_fraction"].item() == 0.0


def test_ratio_below_one_minus_clip_low_with_negative_advantage_is_clipped():
    # loss = max(+0.5, +clamp(0.5, .8, 1.2)) = max(0.5, 0.8) = 0.8, constant -> no gradient
    loss, metrics, grad = _one_token(0.5, -1.0)
    assert loss == pytest.approx(0.8)
    assert grad == 0.0
    assert metrics["clip_fraction_low"].item() == 1.0 and metrics["clip_fraction_high"].item() == 0.0


def test_ratio_below_one_minus_clip_low_with_positive_advantage_is_not_clipped():
    # loss = max(-0.5, -0.8) = -0.5 = -ratio -> d loss / d logprob = -0.5
    loss, metrics, grad = _one_token(0.5, +1.0)
    assert loss == pytest.approx(-0.5)
    assert grad == pytest.approx(-0.5)
    assert metrics["clip_fraction"].item() == 0.0


def test_clip_low_and_clip_high_bound_the_ratio_separately():
    # clip-higher: with clip_high .28 a ratio of 1.25 and A = +1 is inside [.8, 1.28] -> loss -1.25, not clipped
    loss, metrics, grad = _one_token(1.25, +1.0, clip_low=0.2, clip_high=0.28)
    assert loss == pytest.approx(-1.25) and grad == pytest.approx(-1.25)
    # ... while the symmetric 0.2 would clip it at 1.2
    assert _one_token(1.25, +1.0, clip_low=0.2, clip_high=0.2)[0] == pytest.approx(-1.2)
    # the lower bound stays 1 - clip_low = .8: ratio .75 with A = -1 -> max(.75, .8) = .8, clipped
    loss, metrics, grad = _one_token(0.75, -1.0, clip_low=0.2, clip_high=0.28)
    assert loss == pytest.approx(0.8) and grad == 0.0
    assert metrics["clip_fraction_low"].item() == 1.0
    # a larger clip_low lets it through: bound .7 -> loss .75
    assert _one_token(0.75, -1.0, clip_low=0.3, clip_high=0.28)[0] == pytest.approx(0.75)


# Ratio 1 everywhere (logprobs == old), so each valid token's loss is -advantage:
#   row 0: 3 valid tokens, losses [-1, -2, -3]
#   row 1: 1 valid token,  loss   [-4]          (rest padding)
#   row 2: no valid token (its garbage values must be ignored)
_ADVANTAGES_BT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0], [100.0, 100.0, 100.0]])
_RAGGED_MASK_BT = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        ("token_mean", -2.5),  # (-1 - 2 - 3 - 4) / 4 tokens
        ("seq_mean_token_mean", -3.0),  # (mean(-1, -2, -3) = -2, -4) -> mean over the 2 non-empty rows = -3
        ("seq_mean_token_sum", -5.0),  # (-6, -4) -> mean over the 2 non-empty rows = -5
    ],
)
def test_aggregation_modes_on_a_ragged_mask_match_hand_computed_values(aggregation, expected):
    logprobs_bt = torch.full((3, 3), -0.7)
    for mask_bt in (_RAGGED_MASK_BT, _RAGGED_MASK_BT.float()):
        loss, _ = ppo_clip_policy_loss(logprobs_bt, logprobs_bt, _ADVANTAGES_BT, mask_bt, aggregation=aggregation)
        assert loss.item() == pytest.approx(expected)


def test_per_response_advantages_of_shape_b_by_1_broadcast_over_tokens():
    logprobs_bt = torch.zeros(2, 3)
    mask_bt = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, _ = ppo_clip_policy_loss(logprobs_bt, logprobs_bt, torch.tensor([[1.0], [-2.0]]), mask_bt)
    assert loss.item() == pytest.approx((-1 - 1 - 1 + 2) / 4)  # -0.25
    with pytest.raises(ValueError, match="unsqueeze"):
        ppo_clip_policy_loss(logprobs_bt, logprobs_bt, torch.tensor([1.0, -2.0]), mask_bt)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_rows_and_batches_with_zero_valid_tokens_give_finite_losses_and_gradients(aggregation):
    # padding holds -inf and NaN log-probs: they must reach neither the loss nor the gradient
    logprobs_bt = torch.tensor([[-1.0, float("-inf")], [float("nan"), float("nan")]], requires_grad=True)
    old_logprobs_bt = torch.tensor([[-1.0, 0.0], [float("nan"), -2.0]])
    ref_logprobs_bt = torch.tensor([[-1.0 + LN2, float("nan")], [0.0, float("-inf")]])
    advantages_bt = torch.tensor([[2.0, float("nan")], [1.0, 1.0]])
    mask_bt = torch.tensor([[1.0, 0.0], [0.0, 0.0]])  # row 1 empty
    loss, metrics = policy_loss_with_kl(
        logprobs_bt, old_logprobs_bt, advantages_bt, mask_bt,
        ref_logprobs_bt=ref_logprobs_bt, kl_coef=0.5, aggregation=aggregation,
    )
    loss.backward()
    # one valid token: ratio 1, A = 2 -> pg -2; k3 with d = ln2: 2 - ln2 - 1 = 0.30685 -> -2 + 0.5 * 0.30685
    assert loss.item() == pytest.approx(-2 + 0.5 * (1 - LN2))
    assert torch.isfinite(logprobs_bt.grad).all()
    assert logprobs_bt.grad[0, 1] == 0 and (logprobs_bt.grad[1] == 0).all()
    assert all(torch.isfinite(value) for value in metrics.values())

    empty_bt = torch.zeros(2, 2)
    logprobs_bt = torch.zeros(2, 2, requires_grad=True)
    loss, metrics = policy_loss_with_kl(
        logprobs_bt, empty_bt, torch.ones(2, 2), empty_bt, ref_logprobs_bt=empty_bt, kl_coef=1.0,
        aggregation=aggregation,
    )
    loss.backward()
    assert loss.item() == 0.0
    assert (logprobs_bt.grad == 0).all()
    assert all(value.item() == 0.0 for value in metrics.values())


def test_kl_estimators_k1_k2_k3_match_hand_computed_values():
    logprobs_bt = torch.tensor([[0.0, 0.0, -1.0]])
    ref_logprobs_bt = torch.tensor([[LN2, -LN2, -1.0]])
    # d = ref - logprob = [ln2, -ln2, 0]
    # k1 = -d          = [-ln2, ln2, 0]            = [-0.6931, 0.6931, 0]
    # k2 = d^2 / 2     = [ln2^2/2, ln2^2/2, 0]     = [0.2402, 0.2402, 0]
    # k3 = e^d - d - 1 = [2 - ln2 - 1, .5 + ln2 - 1, 0] = [0.3069, 0.1931, 0]
    torch.testing.assert_close(kl_penalty(logprobs_bt, ref_logprobs_bt, "k1"), torch.tensor([[-LN2, LN2, 0.0]]))
    torch.testing.assert_close(
        kl_penalty(logprobs_bt, ref_logprobs_bt, "k2"), torch.tensor([[LN2**2 / 2, LN2**2 / 2, 0.0]])
    )
    torch.testing.assert_close(
        kl_penalty(logprobs_bt, ref_logprobs_bt, "k3"), torch.tensor([[1 - LN2, LN2 - 0.5, 0.0]])
    )
    torch.testing.assert_close(kl_penalty(logprobs_bt, ref_logprobs_bt), kl_penalty(logprobs_bt, ref_logprobs_bt, "k3"))
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(logprobs_bt, ref_logprobs_bt, "k4")


def test_kl_term_is_aggregated_like_the_policy_loss_and_weighted_by_kl_coef():
    logprobs_bt = torch.tensor([[0.0, 0.0, 5.0]])
    ref_logprobs_bt = torch.tensor([[LN2, -LN2, 0.0]])
    mask_bt = torch.tensor([[1, 1, 0]])
    zero_advantages_bt = torch.zeros(1, 3)  # policy term 0
    # k3 over the 2 valid tokens: (1 - ln2) + (ln2 - 0.5) = 0.5 -> token mean 0.25; x kl_coef 0.5 = 0.125
    loss, metrics = policy_loss_with_kl(
        logprobs_bt, logprobs_bt, zero_advantages_bt, mask_bt, ref_logprobs_bt=ref_logprobs_bt, kl_coef=0.5
    )
    assert loss.item() == pytest.approx(0.125)
    assert metrics["kl"].item() == pytest.approx(0.25) and metrics["pg_loss"].item() == 0.0
    # seq_mean_token_sum: one row summing to 0.5 -> 0.25 with kl_coef 0.5
    loss, _ = policy_loss_with_kl(
        logprobs_bt, logprobs_bt, zero_advantages_bt, mask_bt,
        ref_logprobs_bt=ref_logprobs_bt, kl_coef=0.5, aggregation="seq_mean_token_sum",
    )
    assert loss.item() == pytest.approx(0.25)
    # k1 is reported on request: (-ln2 + ln2) / 2 = 0
    _, metrics = policy_loss_with_kl(
        logprobs_bt, logprobs_bt, zero_advantages_bt, mask_bt, ref_logprobs_bt=ref_logprobs_bt, kl_kind="k1"
    )
    assert metrics["kl"].item() == pytest.approx(0.0, abs=1e-7)


def test_kl_coef_without_reference_logprobs_raises():
    x_bt = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="ref_logprobs_bt"):
        policy_loss_with_kl(x_bt, x_bt, x_bt, torch.ones(1, 2), kl_coef=0.1)
    loss, metrics = policy_loss_with_kl(x_bt, x_bt, x_bt, torch.ones(1, 2))
    assert loss.item() == 0.0 and "kl" not in metrics


def test_gradient_step_lowers_logprob_of_negative_advantage_tokens_and_raises_positive_ones():
    logprobs_bt = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    old_logprobs_bt = logprobs_bt.detach().clone()
    advantages_bt = torch.tensor([[-1.0, 1.0]])
    loss, _ = ppo_clip_policy_loss(logprobs_bt, old_logprobs_bt, advantages_bt, torch.ones(1, 2))
    loss.backward()
    # loss = -(A0 r0 + A1 r1) / 2, r = 1 -> d loss / d logprob_i = -A_i / 2 = [+0.5, -0.5]
    torch.testing.assert_close(logprobs_bt.grad, torch.tensor([[0.5, -0.5]]))
    with torch.no_grad():
        stepped_bt = logprobs_bt - 0.1 * logprobs_bt.grad
    assert stepped_bt[0, 0] < -1.0 < stepped_bt[0, 1]
    new_loss, _ = ppo_clip_policy_loss(stepped_bt, old_logprobs_bt, advantages_bt, torch.ones(1, 2))
    assert new_loss < loss


def test_metrics_report_ratio_mean_and_approx_kl_over_valid_tokens():
    logprobs_bt = torch.tensor([[math.log(1.5), math.log(0.5), 3.0]])
    mask_bt = torch.tensor([[True, True, False]])
    _, metrics = ppo_clip_policy_loss(logprobs_bt, torch.zeros(1, 3), torch.zeros(1, 3), mask_bt)
    # ratio_mean = (1.5 + 0.5) / 2 = 1
    # approx_kl = mean(r - ln r - 1) = ((0.5 - ln 1.5) + (-0.5 + ln 2)) / 2 = (0.094535 + 0.193147) / 2 = 0.143841
    assert metrics["ratio_mean"].item() == pytest.approx(1.0)
    assert metrics["approx_kl"].item() == pytest.approx(0.143841, abs=1e-6)
    assert metrics["clip_fraction"].item() == 0.0  # advantage 0: nothing to clip
    assert not any(value.requires_grad for value in metrics.values())


def test_aggregate_loss_alone_ignores_masked_values_and_rejects_unknown_modes():
    values_bt = torch.tensor([[1.0, float("nan")], [3.0, 5.0]])
    mask_bt = torch.tensor([[1, 0], [1, 1]])
    assert aggregate_loss(values_bt, mask_bt).item() == pytest.approx(3.0)  # (1 + 3 + 5) / 3
    assert aggregate_loss(values_bt, mask_bt, "seq_mean_token_mean").item() == pytest.approx(2.5)  # (1 + 4) / 2
    with pytest.raises(ValueError, match="token_mean, seq_mean_token_mean, seq_mean_token_sum"):
        aggregate_loss(values_bt, mask_bt, "token_sum")


def test_invalid_clip_ranges_and_mismatched_shapes_raise_value_errors():
    x_bt = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="clip_low"):
        ppo_clip_policy_loss(x_bt, x_bt, x_bt, torch.ones(1, 2), clip_low=1.0)
    with pytest.raises(ValueError, match="clip_high"):
        ppo_clip_policy_loss(x_bt, x_bt, x_bt, torch.ones(1, 2), clip_high=-0.1)
    with pytest.raises(ValueError, match="mask_bt shape"):
        ppo_clip_policy_loss(x_bt, x_bt, x_bt, torch.ones(1, 3))


@pytest.mark.parametrize(
    ("aggregation", "numerator", "count"),
    [
        ("token_mean", -10.0, 4),  # -1 - 2 - 3 - 4 over 4 tokens
        ("seq_mean_token_mean", -6.0, 2),  # mean(-1, -2, -3) + (-4) over 2 non-empty rows
        ("seq_mean_token_sum", -10.0, 2),  # (-6) + (-4) over 2 non-empty rows
    ],
)
def test_aggregate_parts_are_the_sum_and_count_behind_each_mode(aggregation, numerator, count):
    values_bt = -_ADVANTAGES_BT
    got_numerator, got_count = aggregate_parts(values_bt, _RAGGED_MASK_BT, aggregation)
    assert got_numerator.item() == pytest.approx(numerator) and got_count.item() == count


def test_summing_parts_over_micro_batches_gives_the_global_token_mean_not_a_mean_of_means():
    # Two micro-batches as the trainer sees them: 3 tokens of loss -1 each, then 1 token of loss -5.
    parts = [aggregate_parts(torch.full((1, 3), -1.0), torch.ones(1, 3)),
             aggregate_parts(torch.full((1, 1), -5.0), torch.ones(1, 1))]
    numerator = sum(p[0] for p in parts)
    count = sum(p[1] for p in parts)
    assert (numerator / count).item() == pytest.approx(-2.0)  # (-3 - 5) / 4; a mean of means would give -3


def test_policy_token_terms_aggregate_to_policy_loss_with_kl():
    torch.manual_seed(0)
    logprobs_bt = torch.randn(3, 4) - 1.0
    old_bt, ref_bt = logprobs_bt + 0.1 * torch.randn(3, 4), logprobs_bt + 0.3 * torch.randn(3, 4)
    advantages_bt = torch.tensor([[1.0], [-0.5], [2.0]])
    mask_bt = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    for aggregation in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        want, _ = policy_loss_with_kl(logprobs_bt, old_bt, advantages_bt, mask_bt, ref_logprobs_bt=ref_bt,
                                      kl_coef=0.1, aggregation=aggregation)
        terms = policy_token_terms(logprobs_bt, old_bt, advantages_bt, mask_bt, ref_logprobs_bt=ref_bt, kl_coef=0.1)
        got = aggregate_loss(terms.loss_bt, terms.valid_bt, aggregation)
        assert got.item() == pytest.approx(want.item(), rel=1e-6)
        assert set(terms.stats_bt) >= {"pg_loss", "kl", "clip_fraction", "ratio_mean"}


def test_tis_weights_are_the_probability_ratio_truncated_at_the_cap_and_one_where_masked():
    from megatron_tlt.rl.losses import truncated_importance_weights

    # p_train / p_rollout per token: e^ln2 = 2 (kept under a cap of 3), e^(2 ln 2) = 4 (cut to 3), e^-ln2 = 0.5
    old = torch.tensor([[LN2, 2 * LN2, -LN2, 7.0]])
    rollout = torch.zeros(1, 4)
    mask = torch.tensor([[1, 1, 1, 0]])
    weights, stats = truncated_importance_weights(old, rollout, mask, cap=3.0)
    assert weights[0].tolist() == pytest.approx([2.0, 3.0, 0.5, 1.0])
    assert stats["tis_truncated"].tolist() == [[0.0, 1.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="cap must be >= 1"):
        truncated_importance_weights(old, rollout, mask, cap=0.5)


def test_tis_weighs_the_policy_gradient_term_per_token_and_not_the_kl():
    # One token, ratio 1 (on-policy), advantage 1: pg = -1 per token; weights 2 and 0.5 scale it to -2 and -0.5,
    # and its gradient d pg / d logprob = -w. The KL term (k1 = logprob - ref) keeps its own weight, 1.
    logprobs = torch.zeros(1, 2, requires_grad=True)
    weights = torch.tensor([[2.0, 0.5]])
    terms = policy_token_terms(logprobs, logprobs.detach(), torch.ones(1, 1), torch.ones(1, 2),
                               ref_logprobs_bt=torch.full((1, 2), -1.0), kl_coef=0.5, kl_kind="k1",
                               importance_weights_bt=weights)
    assert terms.stats_bt["pg_loss"].tolist() == [[-2.0, -0.5]]
    assert terms.loss_bt[0].tolist() == pytest.approx([-2.0 + 0.5, -0.5 + 0.5])
    terms.loss_bt.sum().backward()
    assert logprobs.grad[0].tolist() == pytest.approx([-2.0 + 0.5, -0.5 + 0.5])
