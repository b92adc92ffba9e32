"""PPO-clip / GRPO policy loss and the KL penalty: pure functions of per-token tensors.

Conventions:
  * suffix ``_bt`` = ``[batch, tokens]``: one row per response, one column per response token
    (prompt tokens are not in these tensors, or are masked out);
  * ``logprobs_bt`` are log-probabilities of the *sampled* tokens under the policy being trained (with
    grad); ``old_logprobs_bt`` under the policy that generated the rollout; ``ref_logprobs_bt`` under
    the frozen reference policy (the last two without grad);
  * ``mask_bt`` (bool or float) marks valid tokens: non-zero = valid. Values are a validity flag, not
    weights. Masked positions may hold anything (padding, -inf, NaN): they are replaced before any
    arithmetic, so they reach neither the loss nor the gradient;
  * losses are *minimised*; a row with zero valid tokens contributes nothing and never yields NaN.

Aggregation (how per-token values become one scalar):
  * ``token_mean`` (default): sum over all valid tokens of the batch / number of valid tokens; every
    token weighs the same, so long responses are not down-weighted (DAPO);
  * ``seq_mean_token_mean``: mean over each row's valid tokens, then mean over rows (original GRPO);
  * ``seq_mean_token_sum``: sum over each row's valid tokens, then mean over rows.
  Rows without valid tokens are left out of the mean over rows; no valid token at all gives 0.
  The normalisation is over this call's batch: with gradient accumulation over micro-batches the
  caller scales each micro-batch's loss to its share of the global batch.

No I/O, no process groups: every function here runs on CPU in a unit test.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from torch import Tensor

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
KLKind = Literal["k1", "k2", "k3"]

AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3")

# Log-ratios are clamped to this range before exp() so one bad token cannot overflow to inf
# (exp(20) ~ 5e8 is still finite in bf16/fp32). Same bound as VeRL's core_algos.
MAX_ABS_LOG_RATIO = 20.0


def _valid_mask(mask_bt: Tensor, like_bt: Tensor, name: str = "logprobs_bt") -> Tensor:
    if like_bt.dim() != 2:
        raise ValueError(f"{name} must be [batch, tokens], got shape {tuple(like_bt.shape)}")
    if mask_bt.shape != like_bt.shape:
        raise ValueError(f"mask_bt shape {tuple(mask_bt.shape)} != {name} shape {tuple(like_bt.shape)}")
    return mask_bt.bool()


def _check_same_shape(name: str, tensor_bt: Tensor, like_bt: Tensor) -> None:
    if tensor_bt.shape != like_bt.shape:
        raise ValueError(f"{name} shape {tuple(tensor_bt.shape)} != logprobs_bt shape {tuple(like_bt.shape)}")


def _masked(values_bt: Tensor, valid_bt: Tensor) -> Tensor:
    """``values_bt`` as float32 with invalid positions set to 0 (in the forward and the backward)."""
    return torch.where(valid_bt, values_bt.float(), 0.0)


def aggregate_parts(values_bt: Tensor, mask_bt: Tensor, aggregation: Aggregation = "token_mean") -> tuple[Tensor, Tensor]:
    """``(numerator, count)`` whose ratio is ``aggregate_loss``: the numerator is a sum (over tokens, or
    over rows of per-row values) and the count is the valid tokens or non-empty rows (int).

    Sums of both over micro-batches and data-parallel ranks give the aggregate of the *global* batch,
    which is how the trainer normalises (Megatron's ``calculate_per_token_loss``).
    """
    valid_bt = _valid_mask(mask_bt, values_bt, "values_bt")
    values_bt = _masked(values_bt, valid_bt)
    num_tokens_b = valid_bt.sum(dim=1)
    if aggregation == "token_mean":
        return values_bt.sum(), num_tokens_b.sum()
    if aggregation == "seq_mean_token_mean":
        per_seq_b = values_bt.sum(dim=1) / num_tokens_b.clamp(min=1)
    elif aggregation == "seq_mean_token_sum":
        per_seq_b = values_bt.sum(dim=1)
    else:
        raise ValueError(f"unknown aggregation {aggregation!r}; known: {', '.join(AGGREGATIONS)}")
    # Empty rows have per_seq 0, so summing all rows and counting the non-empty ones leaves them out.
    return per_seq_b.sum(), (num_tokens_b > 0).sum()


def aggregate_loss(values_bt: Tensor, mask_bt: Tensor, aggregation: Aggregation = "token_mean") -> Tensor:
    """Reduces per-token ``values_bt`` [b, t] over the valid tokens of ``mask_bt`` [b, t] to a scalar.

    See the module docstring for the three modes. Invalid positions are ignored, whatever they hold.
    """
    numerator, count = aggregate_parts(values_bt, mask_bt, aggregation)
    return numerator / count.clamp(min=1)


def kl_penalty(logprobs_bt: Tensor, ref_logprobs_bt: Tensor, kind: KLKind = "k3") -> Tensor:
    """Per-token estimate [b, t] of KL(policy || reference) from tokens sampled by the policy.

    With ``d = ref_logprobs - logprobs`` (log of ref/policy at the sampled token), Schulman's estimators
    (http://joschu.net/blog/kl-approx.html):
      * ``k1 = -d``: unbiased, high variance, can be negative per token;
      * ``k2 = d**2 / 2``: biased, low variance, non-negative;
      * ``k3 = exp(d) - d - 1`` (default): unbiased, low variance, non-negative.
    No mask is applied; mask or aggregate the result with ``aggregate_loss``. Computed in float32.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; known: {', '.join(KL_KINDS)}")
    _check_same_shape("ref_logprobs_bt", ref_logprobs_bt, logprobs_bt)
    log_ratio_bt = ref_logprobs_bt.float() - logprobs_bt.float()
    if kind == "k1":
        return -log_ratio_bt
    if kind == "k2":
        return 0.5 * log_ratio_bt.square()
    log_ratio_bt = log_ratio_bt.clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO)
    return torch.exp(log_ratio_bt) - log_ratio_bt - 1.0


def ppo_clip_policy_loss(
    logprobs_bt: Tensor,
    old_logprobs_bt: Tensor,
    advantages_bt: Tensor,
    mask_bt: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    aggregation: Aggregation = "token_mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate loss with separate lower and upper ratio bounds (DAPO's clip-higher).

    Per token, with ``ratio = exp(logprobs - old_logprobs)`` and advantage ``A``:
        loss = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high))
    so a token is clipped (constant loss, zero gradient) only when moving further would over-exploit:
    ``A > 0`` and ``ratio > 1 + clip_high``, or ``A < 0`` and ``ratio < 1 - clip_low``. A larger
    ``clip_high`` lets low-probability tokens with positive advantage grow more (keeps entropy up).

    Args:
        logprobs_bt: [b, t] current policy log-probs of the sampled tokens (with grad).
        old_logprobs_bt: [b, t] rollout policy log-probs of the same tokens.
        advantages_bt: [b, t], or [b, 1] for one advantage per response (broadcast over tokens).
        mask_bt: [b, t] bool/float, non-zero at valid response tokens.
        clip_low: lower ratio bound is ``1 - clip_low``; in [0, 1).
        clip_high: upper ratio bound is ``1 + clip_high``; >= 0.
        aggregation: "token_mean" | "seq_mean_token_mean" | "seq_mean_token_sum" (module docstring).

    Returns:
        ``(loss, metrics)``: the scalar loss and detached scalar tensors (``.item()`` them when logging,
        not in the step, to avoid a device sync), all token means over valid tokens:
        ``clip_fraction`` (tokens clipped at either bound), ``clip_fraction_low``, ``clip_fraction_high``,
        ``approx_kl`` (k3 estimate of KL(old || current) - the samples come from the old policy),
        ``ratio_mean``.
    """
    terms = ppo_clip_token_terms(logprobs_bt, old_logprobs_bt, advantages_bt, mask_bt,
                                 clip_low=clip_low, clip_high=clip_high)
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; known: {', '.join(AGGREGATIONS)}")
    loss = aggregate_loss(terms.loss_bt, terms.valid_bt, aggregation)
    metrics = {name: aggregate_loss(values_bt, terms.valid_bt) for name, values_bt in terms.stats_bt.items()}
    return loss, metrics


@dataclasses.dataclass(frozen=True)
class TokenTerms:
    """Per-token pieces of the policy loss, before aggregation."""

    loss_bt: Tensor
    """Loss per token (0 at invalid positions), with grad."""
    valid_bt: Tensor
    """Bool mask of valid tokens."""
    stats_bt: dict[str, Tensor]
    """Detached per-token float diagnostics; their token means are the reported metrics."""


def ppo_clip_token_terms(
    logprobs_bt: Tensor, old_logprobs_bt: Tensor, advantages_bt: Tensor, mask_bt: Tensor, *,
    clip_low: float = 0.2, clip_high: float = 0.2,
) -> TokenTerms:
    """The PPO clipped surrogate per token (see ``ppo_clip_policy_loss``), with its diagnostics:
    ``clip_fraction``, ``clip_fraction_low``, ``clip_fraction_high``, ``approx_kl``, ``ratio_mean``."""
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1) so the lower ratio bound 1 - clip_low stays > 0, got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    valid_bt = _valid_mask(mask_bt, logprobs_bt)
    _check_same_shape("old_logprobs_bt", old_logprobs_bt, logprobs_bt)
    if advantages_bt.dim() != 2 or advantages_bt.shape[0] != logprobs_bt.shape[0] or \
            advantages_bt.shape[1] not in (1, logprobs_bt.shape[1]):
        raise ValueError(
            f"advantages_bt must be [b, t] or [b, 1] for logprobs_bt {tuple(logprobs_bt.shape)}, got "
            f"{tuple(advantages_bt.shape)}; per-response advantages [b] need .unsqueeze(-1)"
        )

    # Sanitise first: masked positions may hold -inf/NaN, and 0 * NaN in a backward would poison grads.
    log_ratio_bt = _masked(logprobs_bt.float() - old_logprobs_bt.float(), valid_bt)
    log_ratio_bt = log_ratio_bt.clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO)
    advantages_bt = _masked(advantages_bt.detach().expand_as(logprobs_bt), valid_bt)
    ratio_bt = torch.exp(log_ratio_bt)

    unclipped_bt = -advantages_bt * ratio_bt
    clipped_bt = -advantages_bt * ratio_bt.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_bt = torch.where(valid_bt, torch.maximum(unclipped_bt, clipped_bt), 0.0)

    with torch.no_grad():
        is_clipped_bt = clipped_bt > unclipped_bt  # the clipped term is the active one: no gradient
        stats_bt = {
            "clip_fraction": is_clipped_bt.float(),
            "clip_fraction_low": (is_clipped_bt & (ratio_bt < 1.0)).float(),
            "clip_fraction_high": (is_clipped_bt & (ratio_bt > 1.0)).float(),
            # kl_penalty(old, current) = ratio - log(ratio) - 1: KL(old || current) sampled from old.
            "approx_kl": kl_penalty(torch.zeros_like(log_ratio_bt), log_ratio_bt, "k3"),
            "ratio_mean": ratio_bt.detach(),
        }
    return TokenTerms(loss_bt=loss_bt, valid_bt=valid_bt, stats_bt=stats_bt)


def truncated_importance_weights(old_logprobs_bt: Tensor, rollout_logprobs_bt: Tensor, mask_bt: Tensor, *,
                                 cap: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance sampling (TIS) of the rollout engine's mismatch, per token [b, t], detached.

    The engine samples from its own numerics (bf16, FP8, other kernels), not exactly the policy the trainer
    computes: with ``w = p_train(token) / p_rollout(token) = exp(old_logprobs - rollout_logprobs)``, the policy
    gradient weighted by ``min(w, cap)`` corrects that numeric gap at a bounded variance (VeRL's rollout
    correction, slime's ``--use-tis``). Both log-probs are before temperature and top-p: the sampler's own
    tempering is not corrected here. Returns the weights (1 at invalid positions) and their per-token
    diagnostics ``tis_weight`` (the weight used) and ``tis_truncated`` (1 where the cap cut it).
    """
    if cap < 1.0:
        raise ValueError(f"the TIS cap must be >= 1 (1 keeps no token's weight above the rollout's), got {cap}")
    valid_bt = _valid_mask(mask_bt, old_logprobs_bt, "old_logprobs_bt")
    _check_same_shape("rollout_logprobs_bt", rollout_logprobs_bt, old_logprobs_bt)
    log_w_bt = _masked(old_logprobs_bt.detach().float() - rollout_logprobs_bt.detach().float(), valid_bt)
    w_bt = torch.exp(log_w_bt.clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO))
    weights_bt = torch.where(valid_bt, w_bt.clamp(max=cap), 1.0)
    return weights_bt, {"tis_weight": weights_bt, "tis_truncated": (valid_bt & (w_bt > cap)).float()}


def policy_token_terms(
    logprobs_bt: Tensor, old_logprobs_bt: Tensor, advantages_bt: Tensor, mask_bt: Tensor, *,
    ref_logprobs_bt: Tensor | None = None, kl_coef: float = 0.0, kl_kind: KLKind = "k3",
    clip_low: float = 0.2, clip_high: float = 0.2, importance_weights_bt: Tensor | None = None,
) -> TokenTerms:
    """Per-token ``w * pg + kl_coef * kl`` with the diagnostics of ``ppo_clip_token_terms`` plus ``pg_loss``
    and, with a reference, ``kl``. ``importance_weights_bt`` (detached; ``truncated_importance_weights``) weighs
    the policy-gradient term only, as VeRL's rollout correction does; None: 1. Aggregation is linear, so
    aggregating these terms equals ``policy_loss_with_kl``; the trainer aggregates them over its whole batch."""
    if kl_coef != 0.0 and ref_logprobs_bt is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs_bt; pass the reference log-probs or set kl_coef=0")
    terms = ppo_clip_token_terms(logprobs_bt, old_logprobs_bt, advantages_bt, mask_bt,
                                 clip_low=clip_low, clip_high=clip_high)
    if importance_weights_bt is not None:
        _check_same_shape("importance_weights_bt", importance_weights_bt, logprobs_bt)
        terms = dataclasses.replace(terms, loss_bt=terms.loss_bt * importance_weights_bt.detach().float())
    stats_bt = dict(terms.stats_bt, pg_loss=terms.loss_bt.detach())
    if ref_logprobs_bt is None:
        return dataclasses.replace(terms, stats_bt=stats_bt)
    valid_bt = terms.valid_bt
    kl_bt = torch.where(valid_bt, kl_penalty(_masked(logprobs_bt, valid_bt), _masked(ref_logprobs_bt, valid_bt), kl_kind), 0.0)
    stats_bt["kl"] = kl_bt.detach()
    return TokenTerms(loss_bt=terms.loss_bt + kl_coef * kl_bt, valid_bt=valid_bt, stats_bt=stats_bt)


def policy_loss_with_kl(
    logprobs_bt: Tensor,
    old_logprobs_bt: Tensor,
    advantages_bt: Tensor,
    mask_bt: Tensor,
    *,
    ref_logprobs_bt: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: KLKind = "k3",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    aggregation: Aggregation = "token_mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """``ppo_clip_policy_loss + kl_coef * KL(policy || reference)``, the KL aggregated like the policy loss.

    Args: those of ``ppo_clip_policy_loss`` plus
        ref_logprobs_bt: [b, t] reference-policy log-probs of the sampled tokens; required when
            ``kl_coef != 0``. When given, the KL is reported in the metrics even if ``kl_coef == 0``.
        kl_coef: weight of the KL term in the loss (GRPO's beta).
        kl_kind: estimator, see ``kl_penalty`` ("k3" by default, as in GRPO).

    Returns:
        ``(loss, metrics)``: the metrics of ``ppo_clip_policy_loss`` plus ``pg_loss`` and, with a
        reference, ``kl`` (the aggregated, unweighted KL).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; known: {', '.join(AGGREGATIONS)}")
    terms = policy_token_terms(logprobs_bt, old_logprobs_bt, advantages_bt, mask_bt, ref_logprobs_bt=ref_logprobs_bt,
                               kl_coef=kl_coef, kl_kind=kl_kind, clip_low=clip_low, clip_high=clip_high)
    loss = aggregate_loss(terms.loss_bt, terms.valid_bt, aggregation)
    metrics = {name: aggregate_loss(values_bt, terms.valid_bt) for name, values_bt in terms.stats_bt.items()
               if name not in ("pg_loss", "kl")}
    for name in ("pg_loss", "kl"):  # aggregated like the loss they are part of
        if name in terms.stats_bt:
            metrics[name] = aggregate_loss(terms.stats_bt[name], terms.valid_bt, aggregation)
    return loss, metrics
