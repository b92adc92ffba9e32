"""Does the rollout engine sample the policy being trained? Measured every step, from log-probs both sides have.

The engine returns log p(token) of every token it sampled (``RolloutResult.logprobs``); the trainer recomputes
the same log-probs in the update's forward (on-policy) or the log-prob pass. Their gap per token, over the
response tokens of the step:
  * ``prob_error``: the mean of exp(|log p_train - log p_rollout|), NeMo-RL's multiplicative probability error
    (``token_mult_prob_error``): 1.0 when they agree;
  * ``logprob_diff_mean`` / ``logprob_diff_max``: the mean and the largest |log p_train - log p_rollout|;
  * ``logprob_kl``: KL(rollout || train), estimated from the sampled tokens (Schulman's k3, never negative);
  * ``past_bound_share``: the share of tokens whose exp|diff| is past ``rollout.agreement_bound``.
On CPU in fp32 a correct engine reads ~0 (prob error 1.0000): an exact alarm. On a GPU in bf16 the gap is real
and is what truncated importance sampling corrects (``algorithm.tis_cap``, ``rl/losses.py``). Both sides are the
model's own distribution, before temperature and top-p (vLLM's ``raw_logprobs``; the trainer applies neither), so
the check holds at any temperature; neither TIS nor these figures account for the sampler's temperature itself.
A wrong engine (a weight it never received, a layout mapped wrongly) reads far past any bound: ``AgreementMonitor``
stops the run.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_tlt.config import RolloutConfig
from megatron_tlt.rl.losses import MAX_ABS_LOG_RATIO, kl_penalty

logger = logging.getLogger(__name__)

# Per-token values the update's loss reports (token sums, divided by the token count), and the one it maxes.
TOKEN_STATS = ("agreement_abs_diff", "agreement_prob_error", "agreement_kl", "agreement_past_bound")
MAX_STAT = "agreement_abs_diff_max"
FALLBACK_SEQUENCES = 8
"""Sequences a step whose update trained on none (every group filtered) measures by a forward of their own."""

_SUMMARY_NAMES = {
    "agreement_prob_error": "rollout/prob_error",
    "agreement_abs_diff": "rollout/logprob_diff_mean",
    MAX_STAT: "rollout/logprob_diff_max",
    "agreement_kl": "rollout/logprob_kl",
    "agreement_past_bound": "rollout/past_bound_share",
}


class RolloutMismatchError(RuntimeError):
    """The engine does not sample the policy the trainer trains; the message says by how much."""


def token_stats(train_logprobs_bt: Tensor, rollout_logprobs_bt: Tensor, valid_bt: Tensor, *,
                bound: float) -> dict[str, Tensor]:
    """Per-token [b, t] agreement values (0 at invalid positions; detached, float32): their token means are the
    step's figures. ``MAX_STAT`` is the largest |diff| (a scalar; 0 with no valid token)."""
    valid_bt = valid_bt.bool()
    train_bt = torch.where(valid_bt, train_logprobs_bt.detach().float(), 0.0)
    rollout_bt = torch.where(valid_bt, rollout_logprobs_bt.detach().float(), 0.0)
    unclamped_bt = (train_bt - rollout_bt).abs()  # the max is said as it is; the means clamp one absurd token
    abs_bt = unclamped_bt.clamp(max=MAX_ABS_LOG_RATIO)
    prob_error_bt = torch.exp(abs_bt)
    # k3 of KL(rollout || train) sampled from the rollout, r - log r - 1 with r = p_train / p_rollout; >= 0 exactly
    # (rounding made -1e-10). With temperature or top-p the tokens come from the tempered sampler, and this is then a
    # measure of the gap, ~0 where the two agree, no longer an unbiased KL.
    kl_bt = kl_penalty(rollout_bt, train_bt, "k3").clamp(min=0.0)
    zero = torch.zeros((), device=abs_bt.device)
    return {
        "agreement_abs_diff": abs_bt,
        "agreement_prob_error": torch.where(valid_bt, prob_error_bt, 0.0),
        "agreement_kl": torch.where(valid_bt, kl_bt, 0.0),
        "agreement_past_bound": (valid_bt & (prob_error_bt > bound)).float(),
        MAX_STAT: unclamped_bt.max() if unclamped_bt.numel() else zero,
    }


def token_sums(train_logprobs_bt: Tensor, rollout_logprobs_bt: Tensor, valid_bt: Tensor, *,
                bound: float) -> dict[str, Tensor]:
    """``token_stats`` summed over the valid tokens, with ``MAX_STAT`` and ``num_tokens``: one pass's report, which
    ``update._reduce_report`` turns into the figures."""
    stats = token_stats(train_logprobs_bt, rollout_logprobs_bt, valid_bt, bound=bound)
    valid_bt = valid_bt.bool()
    return {name: stats[name][valid_bt].sum() for name in TOKEN_STATS} | {
        MAX_STAT: stats[MAX_STAT], "num_tokens": valid_bt.sum().float()}


def combine(per_update: list[dict[str, float]]) -> dict[str, float]:
    """The step's figures from each optimizer step's (``trainer.updates_per_step`` > 1): means weighted by the
    tokens each measured, the largest max, the tokens summed."""
    measured = [m for m in per_update if m.get("agreement_tokens")]
    if not measured:
        return {"agreement_tokens": 0.0}
    tokens = sum(m["agreement_tokens"] for m in measured)
    combined = {key: sum(m[key] * m["agreement_tokens"] for m in measured) / tokens for key in TOKEN_STATS}
    return combined | {MAX_STAT: max(m[MAX_STAT] for m in measured), "agreement_tokens": tokens}


def label_row(sample, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """A sample's rollout log-probs at the label positions of prompt + response ([len - 1]; 0 at the prompt's),
    as the update's rows are laid out (label t predicts token t + 1); None when the engine gave none."""
    if sample.rollout_logprobs is None:
        return None
    if len(sample.rollout_logprobs) != len(sample.response_ids):
        raise ValueError(f"{len(sample.rollout_logprobs)} rollout log-probs for a response of "
                         f"{len(sample.response_ids)} tokens")
    row = torch.zeros(len(sample.prompt_ids) + len(sample.response_ids) - 1, dtype=torch.float32)
    row[len(sample.prompt_ids) - 1:] = torch.tensor(sample.rollout_logprobs, dtype=torch.float32)
    return row.to(device)


def spread(count: int, most: int) -> list[int]:
    """Up to ``most`` indices of ``range(count)``, evenly spread (GRPO groups are contiguous: span the prompts)."""
    if count <= most:
        return list(range(count))
    return [i * count // most for i in range(most)]


def summary_fields(update_metrics: dict[str, float]) -> dict[str, float]:
    """The step's agreement figures under their summary names (none where the step measured no token)."""
    if not update_metrics.get("agreement_tokens"):
        return {}
    fields = {name: update_metrics[key] for key, name in _SUMMARY_NAMES.items() if key in update_metrics}
    fields["rollout/agreement_tokens"] = update_metrics["agreement_tokens"]
    return fields


def without_agreement(update_metrics: dict[str, float]) -> dict[str, float]:
    """The update's own metrics, the agreement figures taken out (they go under ``rollout/``)."""
    return {k: v for k, v in update_metrics.items() if k not in _SUMMARY_NAMES and k != "agreement_tokens"}


def describe(fields: dict[str, float], bound: float) -> str:
    """The figures in words, for the console and the stop's message."""
    return (f"probability error {fields['rollout/prob_error']:.4g} (bound {bound:g}), mean |log p_train - "
            f"log p_rollout| {fields['rollout/logprob_diff_mean']:.3g}, max {fields['rollout/logprob_diff_max']:.3g}, "
            f"KL {fields['rollout/logprob_kl']:.3g}, {100 * fields['rollout/past_bound_share']:.1f}% of "
            f"{fields['rollout/agreement_tokens']:.0f} tokens past the bound")


@dataclasses.dataclass
class AgreementMonitor:
    """Warns on a step past the bound; stops the run after ``stop_after_steps`` steps in a row past the stop level.

    Every rank holds one and sees the same (all-reduced) figures, so every rank stops at the same step.
    """

    bound: float
    stop_level: float
    stop_after_steps: int
    steps_past_stop: int = 0

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> "AgreementMonitor":
        return cls(bound=rollout.agreement_bound, stop_level=rollout.agreement_stop_level,
                   stop_after_steps=rollout.agreement_stop_after_steps)

    def check(self, step: int, fields: dict[str, float]) -> str | None:
        """A warning line when the step is past the bound (None otherwise); raises ``RolloutMismatchError`` when
        the engine has been far past it for ``stop_after_steps`` steps in a row."""
        if not fields:
            return None
        error = fields["rollout/prob_error"]
        far = not math.isfinite(error) or error > self.stop_level
        self.steps_past_stop = self.steps_past_stop + 1 if far else 0
        if self.stop_after_steps and self.steps_past_stop >= self.stop_after_steps:
            raise RolloutMismatchError(
                f"step {step}: the rollout engine does not sample the policy being trained, for "
                f"{self.steps_past_stop} step(s) in a row: {describe(fields, self.bound)}; the stop level is "
                f"{self.stop_level:g} (rollout.agreement_stop_level; rollout.agreement_stop_after_steps=0 only warns)")
        if error <= self.bound:
            return None
        kind = "far past the stop level: the engine is not the policy" if far else "past the bound"
        return f"step {step} rollout: engine and trainer disagree, {kind}: {describe(fields, self.bound)}"

    def check_on_every_rank(self, step: int, fields: dict[str, float], *, is_reporter: bool) -> None:
        """``check`` as the run makes it, after the step is logged: the warning said once (rank 0's log reaches the
        console), and a run stopped on every rank at once, none killed mid-report."""
        try:
            line = self.check(step, fields)
        except RolloutMismatchError:
            dist.barrier()
            raise
        if line is not None and is_reporter:
            logger.warning(line)
