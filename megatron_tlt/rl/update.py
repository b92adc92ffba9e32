"""The policy update: PPO-clip / GRPO loss through Megatron's schedule, DDP and optimizer.

Each optimizer step covers one mini-batch of rollout sequences, split into micro-batches for
gradient accumulation. The loss function hands Megatron a (sum, count) pair and the policy is built
with ``calculate_per_token_loss``: Megatron sums the counts over all micro-batches and all
data-parallel ranks and divides the gradients by that total, so ``token_mean`` is the mean over
every response token of the global mini-batch (not a mean of per-micro-batch means, which would
weigh a token by how crowded its micro-batch is).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_tlt.config import AlgorithmConfig
from megatron_tlt.device import module_device, to_device
from megatron_tlt.model import mcore
from megatron_tlt.model.lm_training import check_microbatch_shapes, length_sorted_chunks, token_width
from megatron_tlt.rl import losses, rollout_agreement
from megatron_tlt.rl.actor import CapturedFeatures, FeatureCapture, compute_logprobs

# Diagnostics summed per token, then divided by the token count of the whole mini-batch.
_TOKEN_STATS = ("pg_loss", "clip_fraction", "clip_fraction_low", "clip_fraction_high", "approx_kl", "ratio_mean", "kl")
_TIS_STATS = ("tis_weight", "tis_truncated")


@dataclasses.dataclass(frozen=True)
class PolicySequence:
    """One rollout sequence as the update sees it."""

    token_ids: Sequence[int]
    """Prompt then response."""
    prompt_len: int
    old_logprobs: torch.Tensor | None
    """[len - 1]: log p(token t+1 | <= t) under the rollout policy (from the log-prob pass). The log-prob
    rows of one micro-batch share a device: they are padded where they are. None when the update is the
    first and only optimizer step on the rollout: the policy is still the rollout's, so the update's own
    forward gives them (detached), with no log-prob pass (``on_policy_logprobs``)."""
    advantage: float
    ref_logprobs: torch.Tensor | None = None
    """[len - 1] under the frozen reference policy, when the KL term is on."""
    rollout_logprobs: torch.Tensor | None = None
    """[len - 1]: what the rollout engine said log p(token t+1) was, at the response positions (anything at the
    prompt's): checked against the trainer's own (``rl/rollout_agreement.py``) and TIS's weights."""


@dataclasses.dataclass(frozen=True)
class PolicyMicroBatch:
    """Right-padded tensors of a few sequences; ``_bs`` are [b, s], ``_bl`` are [b, s - 1] (label positions)."""

    tokens_bs: torch.Tensor
    response_mask_bl: torch.Tensor
    old_logprobs_bl: torch.Tensor | None
    """None: the update's own log-probs, detached (``PolicySequence.old_logprobs``)."""
    ref_logprobs_bl: torch.Tensor | None
    advantages_b: torch.Tensor
    rollout_logprobs_bl: torch.Tensor | None = None


def make_microbatch(sequences: Sequence[PolicySequence], pad_id: int, width: int | None = None, *,
                    device: torch.device, input_multiple: int = 1) -> PolicyMicroBatch:
    """Pad ``sequences`` to ``width`` tokens (default: ``token_width`` of the longest), on ``device``. Label
    position t predicts token t + 1, so it is a response position when t + 1 >= prompt_len. Ids and masks
    are written on the host, log-prob rows padded on their own device; each tensor then moves once."""
    width = width or token_width(max(len(s.token_ids) for s in sequences), input_multiple)
    b = len(sequences)
    tokens = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, width - 1), dtype=torch.bool)
    for row, seq in enumerate(sequences):
        n = len(seq.token_ids)
        tokens[row, :n] = torch.as_tensor(list(seq.token_ids))
        mask[row, seq.prompt_len - 1 : n - 1] = True
    has_ref = sequences[0].ref_logprobs is not None
    has_old = sequences[0].old_logprobs is not None
    has_rollout = sequences[0].rollout_logprobs is not None
    batch = PolicyMicroBatch(
        tokens_bs=tokens, response_mask_bl=mask,
        old_logprobs_bl=_pad_rows([s.old_logprobs for s in sequences], width - 1) if has_old else None,
        ref_logprobs_bl=_pad_rows([s.ref_logprobs for s in sequences], width - 1) if has_ref else None,
        advantages_b=torch.tensor([s.advantage for s in sequences], dtype=torch.float32),
        rollout_logprobs_bl=_pad_rows([s.rollout_logprobs for s in sequences], width - 1) if has_rollout else None)
    return to_device(batch, device)


def _pad_rows(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """[len(rows), width] float32, zero-padded on the right, on the rows' device (one copy per row there,
    not a host round trip for rows the log-prob pass left on the GPU)."""
    padded = torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True).float()
    return torch.nn.functional.pad(padded, (0, width - padded.shape[1]))


def microbatch_order(sequences: Sequence[PolicySequence], micro_batch_size: int, *, same_width: bool,
                     input_multiple: int = 1, max_tokens: int | None = None) -> list[tuple[list[int], int]]:
    """Length-sorted micro-batches (little padding) as (indices into ``sequences``, width to pad to); ``same_width``
    pads all to one length (PP > 1); widths follow ``token_width(.., input_multiple)``; ``max_tokens`` caps the
    padded tokens of one (``trainer.micro_batch_tokens``)."""
    return length_sorted_chunks(range(len(sequences)), lambda i: len(sequences[i].token_ids), micro_batch_size,
                                same_width=same_width, input_multiple=input_multiple, max_tokens=max_tokens)


def make_microbatches(sequences: Sequence[PolicySequence], micro_batch_size: int, pad_id: int, *,
                      same_width: bool, device: torch.device, input_multiple: int = 1) -> list[PolicyMicroBatch]:
    """``microbatch_order``'s micro-batches, padded, on ``device``."""
    return [make_microbatch([sequences[i] for i in chunk], pad_id, width, device=device) for chunk, width in
            microbatch_order(sequences, micro_batch_size, same_width=same_width, input_multiple=input_multiple)]


def _forward_step(data_iterator, model, *, vocab_size: int, settings: AlgorithmConfig, agreement_bound: float | None):
    batch: PolicyMicroBatch = next(data_iterator)
    inputs = batch.tokens_bs[:, :-1].contiguous()
    labels = batch.tokens_bs[:, 1:].contiguous()
    output = model(inputs, mcore.position_ids_like(inputs), None)

    def loss_fn(logits_bsv: torch.Tensor):
        logprobs_bl = -mcore.vocab_parallel_cross_entropy(logits_bsv, labels, vocab_size)
        # On-policy (no log-prob pass): the rollout policy is this one, so the ratio is exactly 1 and
        # the gradient is the policy gradient, as with old log-probs from a separate pass.
        old_bl = batch.old_logprobs_bl if batch.old_logprobs_bl is not None else logprobs_bl.detach()
        weights_bl, tis_stats = None, {}
        if settings.tis_cap is not None:
            weights_bl, tis_stats = losses.truncated_importance_weights(
                old_bl, batch.rollout_logprobs_bl, batch.response_mask_bl, cap=settings.tis_cap)
        terms = losses.policy_token_terms(
            logprobs_bl, old_bl, batch.advantages_b.unsqueeze(-1), batch.response_mask_bl,
            ref_logprobs_bt=batch.ref_logprobs_bl, kl_coef=settings.kl_coef,
            clip_low=settings.clip_low, clip_high=settings.clip_high, importance_weights_bt=weights_bl,
        )
        numerator, count = losses.aggregate_parts(terms.loss_bt, terms.valid_bt, settings.loss_aggregation)
        report = {name: values[terms.valid_bt].sum() for name, values in (terms.stats_bt | tis_stats).items()}
        report["num_tokens"] = terms.valid_bt.sum().float()
        if agreement_bound is not None:  # the trainer's log-probs of the rollout policy against the engine's
            report |= rollout_agreement.token_sums(old_bl, batch.rollout_logprobs_bl, batch.response_mask_bl,
                                                   bound=agreement_bound)
        return numerator, count.to(torch.int), report

    return output, loss_fn


def _reduce_report(reports: list[dict[str, torch.Tensor]], names: tuple[str, ...],
                   max_names: tuple[str, ...] = ()) -> dict[str, float]:
    """Token means of the diagnostics over the whole mini-batch (all micro-batches, all DP ranks); ``max_names``
    are maxima over it instead.

    Only the last pipeline stage holds reports, and TP ranks hold identical ones: exactly one rank
    per (DP rank) contributes, then the sum is shared by every rank.
    """
    stage = mcore.stage_info()
    contributes = stage.is_last_stage and stage.tp_rank == 0
    sums = torch.zeros(len(names), dtype=torch.float64)  # on the CPU on purpose: reduced over gloo, not NCCL
    maxima = torch.zeros(len(max_names), dtype=torch.float64)
    if contributes:
        for report in reports:
            for i, name in enumerate(names):
                if name in report:
                    sums[i] += float(report[name])
            for i, name in enumerate(max_names):
                if name in report:
                    maxima[i] = max(maxima[i].item(), float(report[name]))
    dist.all_reduce(sums)
    if max_names:
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    num_tokens = sums[0].item()
    return {name: sums[i].item() / max(num_tokens, 1.0) for i, name in enumerate(names[1:], start=1)} | {
        name: maxima[i].item() for i, name in enumerate(max_names)} | {"num_tokens": num_tokens}


def agreement_by_forward(model: torch.nn.Module, sequences: Sequence[PolicySequence], *, vocab_size: int,
                         micro_batch_size: int, pad_id: int, bound: float,
                         micro_batch_tokens: int | None = None) -> dict[str, float]:
    """The rollout engine's agreement with the policy (``rl/rollout_agreement.py``) on ``sequences``, which carry
    ``rollout_logprobs``, by a forward of their own: for a step whose update trained on no token. Collective over
    all ranks (a data-parallel rank may bring none); the figures as ``policy_update_step`` reports them."""
    reports = []
    if sequences:
        result = compute_logprobs(model, [s.token_ids for s in sequences], vocab_size=vocab_size,
                                  micro_batch_size=micro_batch_size, pad_id=pad_id,
                                  micro_batch_tokens=micro_batch_tokens)
        for seq, logprobs in zip(sequences, result.token_logprobs):  # empty off the last pipeline stage
            valid = torch.zeros(1, len(seq.token_ids) - 1, dtype=torch.bool, device=logprobs.device)
            valid[0, seq.prompt_len - 1:] = True  # the response's labels, as make_microbatch masks them
            reports.append(rollout_agreement.token_sums(logprobs[None], seq.rollout_logprobs[None].to(logprobs.device),
                                                        valid, bound=bound))
    metrics = _reduce_report(reports, ("num_tokens",) + rollout_agreement.TOKEN_STATS, (rollout_agreement.MAX_STAT,))
    metrics["agreement_tokens"] = metrics.pop("num_tokens")
    return metrics


@dataclasses.dataclass
class UpdateResult:
    metrics: dict[str, float]
    """Token means of the loss terms over the mini-batch, ``num_tokens``, ``grad_norm`` (``skipped`` when
    there was nothing to learn from)."""
    features: CapturedFeatures = dataclasses.field(default_factory=CapturedFeatures)
    """The drafter features the update's forward kept (``capture_features``)."""


def policy_update_step(model: torch.nn.Module, optimizer, sequences: Sequence[PolicySequence], *, vocab_size: int,
                       micro_batch_size: int, pad_id: int, settings: AlgorithmConfig, capture_features: bool = False,
                       max_feature_rows: int | None = None, micro_batch_tokens: int | None = None,
                       agreement_bound: float | None = None) -> UpdateResult:
    """One optimizer step on this rank's share of a mini-batch (collective over all ranks).

    Every rank must call it, also with no sequences of its own (e.g. all its groups were filtered):
    it then contributes a fully masked micro-batch so the gradient all-reduce still meets. With
    ``capture_features`` its forward keeps the drafter features of the newest sequences that fit
    ``max_feature_rows`` (``actor.FeatureCapture``), for a step that runs no log-prob pass. With
    ``agreement_bound`` (every sequence then carries ``rollout_logprobs``) the metrics hold the rollout engine's
    agreement with the trainer (``rl/rollout_agreement.py``) and ``agreement_tokens``; TIS
    (``settings.tis_cap``) needs the rollout log-probs too.
    """
    has_ref = settings.kl_coef != 0.0
    needs_rollout = agreement_bound is not None or settings.tis_cap is not None
    if needs_rollout and any(s.rollout_logprobs is None for s in sequences):
        raise ValueError("the agreement measure and TIS need every sequence's rollout_logprobs (the engine's)")
    local_tokens = sum(len(s.token_ids) - s.prompt_len for s in sequences)
    total_tokens = torch.tensor([local_tokens], dtype=torch.float64)  # on the CPU on purpose: reduced over gloo
    dist.all_reduce(total_tokens)
    if total_tokens.item() == 0:  # nothing to learn from anywhere: an Adam step on zero grads would still move
        return UpdateResult({"num_tokens": 0.0, "skipped": 1.0})
    same_width = mcore.stage_info().pp_size > 1
    device = module_device(model)
    input_multiple = mcore.sequence_multiple(model)
    order = microbatch_order(sequences, micro_batch_size, same_width=same_width, input_multiple=input_multiple,
                             max_tokens=micro_batch_tokens)
    if sequences:
        microbatches = [make_microbatch([sequences[i] for i in chunk], pad_id, width, device=device)
                        for chunk, width in order]
    else:  # a placeholder row: zero valid tokens, so it adds nothing to the sums
        placeholder = PolicySequence(token_ids=[pad_id, pad_id], prompt_len=2, old_logprobs=torch.zeros(1), advantage=0.0,
                                     ref_logprobs=torch.zeros(1) if has_ref else None,
                                     rollout_logprobs=torch.zeros(1) if needs_rollout else None)
        microbatches = [make_microbatch([placeholder], pad_id, device=device, input_multiple=input_multiple)]
    check_microbatch_shapes([tuple(mb.tokens_bs.shape) for mb in microbatches], input_multiple)
    capture = FeatureCapture(model, [s.token_ids for s in sequences], [chunk for chunk, _ in order], max_feature_rows,
                             enabled=capture_features)
    model.train()
    model.zero_grad_buffer()
    optimizer.zero_grad()
    with capture:
        reports = mcore.run_schedule(
            model, functools.partial(_forward_step, vocab_size=vocab_size, settings=settings,
                                     agreement_bound=agreement_bound), microbatches,
            seq_length=max(mb.tokens_bs.shape[1] for mb in microbatches) - 1,
            micro_batch_size=max(mb.tokens_bs.shape[0] for mb in microbatches), forward_only=False,
        )
    update_ok, grad_norm, _ = optimizer.step()
    if not update_ok:
        raise FloatingPointError("optimizer step skipped: gradients overflowed")
    names = ("num_tokens",) + tuple(n for n in _TOKEN_STATS if has_ref or n != "kl")
    names += _TIS_STATS if settings.tis_cap is not None else ()
    names += rollout_agreement.TOKEN_STATS if agreement_bound is not None else ()
    max_names = (rollout_agreement.MAX_STAT,) if agreement_bound is not None else ()
    metrics = _reduce_report(reports, names, max_names)
    if agreement_bound is not None:
        metrics["agreement_tokens"] = metrics["num_tokens"]
    metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
    return UpdateResult(metrics, capture.result())
