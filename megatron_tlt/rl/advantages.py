"""Group-relative advantages (GRPO, RLOO): pure functions from rewards to advantages.

Shape convention: ``_g`` marks a grouped tensor ``[num_prompts, n]`` where row ``i`` holds the rewards
of the ``n`` responses sampled for prompt ``i`` (the rollout returns them grouped by prompt). Every
estimator returns advantages of the same shape, one scalar per response; the trainer broadcasts a
response's advantage over its tokens (``advantages_bt = advantages_g.reshape(-1, 1)``).

Estimators are registered by name (``@register_advantage("grpo")``) so the config picks one with a string
and the trainer calls ``get_advantage_fn(name)(rewards_g)``. Each takes ``rewards_g`` positionally and
its own options by keyword. The names are ``config.ADVANTAGES``: the config checks ``algorithm.advantage``
against that tuple without importing this module, and a name registered here must be listed there.

No I/O, no process groups: every function here runs on CPU in a unit test.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from megatron_tlt.config import ADVANTAGES

if TYPE_CHECKING:  # the estimators only call tensor methods: importing this module needs no torch
    from torch import Tensor

AdvantageFn = Callable[..., "Tensor"]

_ADVANTAGE_FNS: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator registering an advantage estimator under ``name``; a name can be taken only once."""

    def decorate(fn: AdvantageFn) -> AdvantageFn:
        if name in _ADVANTAGE_FNS:
            raise ValueError(f"advantage estimator {name!r} is already registered ({_ADVANTAGE_FNS[name].__name__})")
        if name not in ADVANTAGES:
            raise ValueError(f"advantage estimator {name!r} is not in config.ADVANTAGES {ADVANTAGES}: add it there, "
                             "or algorithm.advantage could never choose it")
        _ADVANTAGE_FNS[name] = fn
        return fn

    return decorate


def known_advantage_names() -> list[str]:
    """Names accepted by ``get_advantage_fn``, sorted."""
    return sorted(_ADVANTAGE_FNS)


def get_advantage_fn(name: str) -> AdvantageFn:
    """The estimator registered under ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return _ADVANTAGE_FNS[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; known: {', '.join(known_advantage_names())}"
        ) from None


def _check_grouped(rewards_g: Tensor) -> Tensor:
    """Validates ``[num_prompts, n]`` and returns the rewards as floating point (rewards may be bool/int)."""
    if rewards_g.dim() != 2:
        raise ValueError(
            f"rewards_g must be [num_prompts, n] (responses grouped by prompt), got shape {tuple(rewards_g.shape)}; "
            "reshape flat rewards with rewards.view(num_prompts, n)"
        )
    return rewards_g if rewards_g.is_floating_point() else rewards_g.float()


@register_advantage("grpo")
def grpo_advantages(rewards_g: Tensor, *, normalize_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO: each reward minus its group's mean, divided by the group's std (if ``normalize_by_std``).

    Args:
        rewards_g: ``[num_prompts, n]`` rewards, one row per prompt.
        normalize_by_std: divide by the group std; ``False`` gives Dr. GRPO's mean-centred rewards.
        eps: added to the std, so a group whose rewards are all equal (std 0) gets advantages 0, not NaN.

    Returns:
        ``[num_prompts, n]`` float advantages; each row sums to zero.

    The std is the *population* std (``unbiased=False``, divide by ``n``), unlike VeRL, which uses
    ``torch.std`` (unbiased, divide by ``n - 1``). Why: the population std is the natural scale of the
    centred rewards (the normalised advantages of a group have mean 0 and variance exactly 1 for every
    ``n``), it is defined for ``n = 1`` (the unbiased one is NaN there), and binary rewards give round
    values ([1, 0, 0, 1] -> [1, -1, -1, 1]). The two differ by the constant factor sqrt((n - 1) / n),
    which an optimiser's learning rate absorbs.
    """
    if eps <= 0:
        raise ValueError(f"eps must be > 0 (it keeps equal-reward groups at 0 instead of NaN), got {eps}")
    rewards_g = _check_grouped(rewards_g)
    centred_g = rewards_g - rewards_g.mean(dim=1, keepdim=True)
    if not normalize_by_std:
        return centred_g
    std_g = rewards_g.std(dim=1, unbiased=False, keepdim=True)
    return centred_g / (std_g + eps)


@register_advantage("rloo")
def rloo_advantages(rewards_g: Tensor) -> Tensor:
    """RLOO: each reward minus the mean of the *other* ``n - 1`` rewards of its group; no std scaling.

    Args:
        rewards_g: ``[num_prompts, n]`` rewards, ``n >= 2``.

    Returns:
        ``[num_prompts, n]`` float advantages. Equals ``n / (n - 1)`` times the mean-centred rewards; the
        baseline excludes the sample itself, so the policy-gradient estimate stays unbiased.
    """
    rewards_g = _check_grouped(rewards_g)
    n = rewards_g.shape[1]
    if n < 2:
        raise ValueError(f"rloo needs at least 2 responses per prompt for a leave-one-out baseline, got n={n}")
    baseline_g = (rewards_g.sum(dim=1, keepdim=True) - rewards_g) / (n - 1)
    return rewards_g - baseline_g


def equal_reward_group_mask(rewards_g: Tensor) -> Tensor:
    """``[num_prompts]`` bool: True for groups whose rewards are all (exactly) equal.

    Such a group (all correct or all wrong) has zero advantages under every group-relative estimator,
    so it carries no learning signal; DAPO's dynamic sampling drops them (``rewards_g[~mask]``) and
    samples more prompts. Exact equality suits verifiable rewards, which take a few discrete values.
    """
    rewards_g = _check_grouped(rewards_g)
    return (rewards_g == rewards_g[:, :1]).all(dim=1)
