"""The EAGLE drafter loss: SmoothL1 on hidden states plus a soft cross-entropy on the policy's distribution.

For a packed example at position t the drafter read (embed(x_{t+1}), f_t) and predicted ``pred_th`` ~ f_{t+1}
(``packing.py`` builds that pairing). Then, per row,

    hidden term = mean over hidden dims of SmoothL1(pred, f_{t+1})                  (beta = 1)
    ce term     = - sum_v softmax(lm_head(f_{t+1}))_v * log_softmax(lm_head(pred))_v
    tv term     = 1/2 sum_v |softmax(lm_head(f_{t+1}))_v - softmax(lm_head(pred))_v|
    loss        = hidden_weight * mean_rows(hidden term) + ce_weight * mean_rows(ce term)
                  + tv_weight * mean_rows(tv term)

softmax(lm_head(f_{t+1})) is the policy's distribution of x_{t+2}, exactly what the drafter's logits are
compared with at verification time. Defaults 1.0 and 0.1 as in EAGLE and TLT (DESIGN.md section 4). The tv
term is the total-variation distance between the two: a draft sampled from the drafter is accepted with
probability 1 - tv at temperature 1, so it is the loss closest to acceptance (off by default, tv_weight 0: then it
is not computed, sparing the micro-step a pass over [rows, vocab]).
The LM head is the policy's, frozen here: no gradient ever reaches it. Logits are [rows, vocab] in float32;
for a large vocabulary the caller bounds the rows per call.

Pure tensor math: no I/O, no process groups.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

DEFAULT_HIDDEN_WEIGHT = 1.0
DEFAULT_CE_WEIGHT = 0.1


def drafter_loss(pred_th: Tensor, target_features_th: Tensor, lm_head_weight_vh: Tensor, *,
                 hidden_weight: float = DEFAULT_HIDDEN_WEIGHT,
                 ce_weight: float = DEFAULT_CE_WEIGHT,
                 tv_weight: float = 0.0) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss (scalar, with grad through ``pred_th`` only) and detached metrics.

    Args:
        pred_th: the drafter's output for each row.
        target_features_th: the policy's post-final-norm hidden state f_{t+1} for each row.
        lm_head_weight_vh: the policy's output projection [vocab, hidden] (current weights).
    Returns:
        ``(loss, metrics)``; metrics: ``hidden_loss``, ``ce_loss``, ``top1_agreement`` (share of rows where the
        drafter's argmax token equals the policy's: the greedy acceptance proxy) and, with ``tv_weight`` set,
        ``tv_distance`` (1 - the sampled draft's acceptance at temperature 1).
    """
    if pred_th.dim() != 2 or pred_th.shape != target_features_th.shape:
        raise ValueError(f"pred_th {tuple(pred_th.shape)} and target_features_th "
                         f"{tuple(target_features_th.shape)} must both be [tokens, hidden]")
    if pred_th.shape[0] == 0:
        raise ValueError("drafter_loss needs at least one row")
    lm_head = lm_head_weight_vh.detach().to(pred_th.dtype)
    target = target_features_th.detach().to(pred_th.dtype)

    hidden_loss = F.smooth_l1_loss(pred_th.float(), target.float(), beta=1.0)  # mean over rows and dims
    with torch.no_grad():
        target_logits_tv = (target @ lm_head.T).float()
        target_probs_tv = torch.softmax(target_logits_tv, dim=-1)
    pred_logits_tv = (pred_th @ lm_head.T).float()
    pred_log_probs_tv = torch.log_softmax(pred_logits_tv, dim=-1)
    ce_loss = -(target_probs_tv * pred_log_probs_tv).sum(-1).mean()
    loss = hidden_weight * hidden_loss + ce_weight * ce_loss
    metrics = {"hidden_loss": hidden_loss.detach(), "ce_loss": ce_loss.detach()}
    if tv_weight:
        tv_distance = 0.5 * (target_probs_tv - pred_log_probs_tv.exp()).abs().sum(-1).mean()
        loss = loss + tv_weight * tv_distance
        metrics["tv_distance"] = tv_distance.detach()

    with torch.no_grad():
        agreement = (pred_logits_tv.argmax(-1) == target_logits_tv.argmax(-1)).float().mean()
    metrics["top1_agreement"] = agreement
    return loss, metrics
