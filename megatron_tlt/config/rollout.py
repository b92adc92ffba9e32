"""The rollout engine and sampling, the RL algorithm and the policy's optimizer."""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

from megatron_tlt.config.checks import ConfigError, _require_at_least_one, check_choices

Advantage = Literal["grpo", "rloo"]
ADVANTAGES = get_args(Advantage)
"""The estimators rl/advantages.py registers (it refuses a name not listed here)."""


@dataclasses.dataclass(kw_only=True)
class RolloutEngineConfig:
    """How each rank's vLLM engine is built (``spec/engine.py`` builds it)."""

    max_model_len: int | None = None
    """Longest prompt + response, in tokens; null: the longest prompt + max_response_tokens, within the model's
    positions, decided when the run starts and written into its config.yaml."""
    dtype: str = "float32"
    """Weights and activations in the engine (match the policy's for exact greedy agreement)."""
    kv_cache_gib: float | None = None
    """KV-cache size of each rank's engine on CPU, in whole GiB (VLLM_CPU_KVCACHE_SPACE: rounded, at least 1).
    null: sized when the run starts from the step's need (its sequences x (longest prompt + max_response_tokens) x
    the model's KV bytes per token, as `tlt plan` counts them, in the engine's dtype), at most half the host memory
    available per local rank, at least 1 GiB, and written into the run's config.yaml. A cache that holds fewer sequences than the step has is warned
    about at start-up with the figures (spec/kv_budget.py). On GPU the cache is what gpu_memory_utilization
    leaves; the same warning comes from the engine's reported blocks."""
    gpu_memory_utilization: float = 0.4
    """Share of GPU memory the colocated engine may take; the rest stays for Megatron."""
    enforce_eager: bool = True
    """Skip graph compilation (CPU start-up ~11 s instead of ~29 s)."""
    seed: int = 0
    """Engine seed; per-request seeds make sampling reproducible regardless."""
    max_num_seqs: int = 256
    """Most sequences decoded together."""
    tensor_parallel_size: int | None = None
    """Ranks that share one engine (vLLM tensor parallelism over consecutive ranks); null: the policy's
    tensor_parallel_size (written into the run's config.yaml). Must divide it. 1 gives every rank a whole engine
    of its own."""
    verify_drafter: bool = True
    """Check the drafter at every hand-over (the first push, every policy sync and drafter push, every wake):
    read its tensors back from the engine's vLLM drafter and compare their checksums with the pushed ones
    (``spec/drafter_integrity.py``). A mismatch pushes again once; if it persists, an ERROR line, a count in
    ``spec/drafter_integrity_failures`` and rollouts without speculation until a push verifies. Costs ~7 ms a
    step on the tiny default, 0.1% of its 5-12 s steps (``spec/drafter_integrity_seconds``). With a
    tensor-parallel engine only the drafter tensors every rank holds whole (fc, norms) are compared."""

    def __post_init__(self) -> None:
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0.0:  # written so that NaN fails too
            raise ConfigError(f"rollout.engine.kv_cache_gib must be > 0 GiB or null (sized from the rollout's "
                              f"need), got {self.kv_cache_gib}")


@dataclasses.dataclass(kw_only=True)
class RolloutConfig:
    """Sampling during RL rollouts."""

    samples_per_prompt: int = 8
    """GRPO group size n."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_response_tokens: int = 192
    engine: RolloutEngineConfig = dataclasses.field(default_factory=RolloutEngineConfig)
    """The colocated vLLM engine of each rank."""
    agreement_bound: float = 1.05
    """Bound on the engine's agreement with the trainer, as NeMo-RL's multiplicative probability error (the mean
    of exp|log p_train - log p_rollout| over the step's response tokens; 1.0 = exact, ~1.0000 on CPU in fp32): a
    step past it is said on the console; a token past it counts in ``rollout/past_bound_share``
    (``rl/rollout_agreement.py``)."""
    agreement_stop_level: float = 1.5
    """A step whose probability error is past this is a wrong engine, not numerics (a weight the engine never got
    read 10-1000x): ``agreement_stop_after_steps`` such steps in a row stop the run."""
    agreement_stop_after_steps: int = 2
    """Steps in a row past ``agreement_stop_level`` that stop the run with what disagreed; 0: warn only."""

    def __post_init__(self) -> None:
        _require_at_least_one("rollout", samples_per_prompt=self.samples_per_prompt,
                              max_response_tokens=self.max_response_tokens)
        if not 0.0 < self.top_p <= 1.0 or self.temperature < 0.0:
            raise ConfigError(f"rollout.top_p must be in (0, 1] and temperature >= 0, got {self.top_p}, "
                              f"{self.temperature}")
        if not 1.0 <= self.agreement_bound <= self.agreement_stop_level or self.agreement_stop_after_steps < 0:
            raise ConfigError(f"rollout.agreement_bound must be >= 1 and <= agreement_stop_level, and "
                              f"agreement_stop_after_steps >= 0 (0: warn only), got {self.agreement_bound}, "
                              f"{self.agreement_stop_level}, {self.agreement_stop_after_steps}")


@dataclasses.dataclass(kw_only=True)
class AlgorithmConfig:
    """Advantages and the policy loss."""

    advantage: Advantage = "grpo"
    """Advantage estimator."""
    clip_low: float = 0.2
    """PPO ratio clip below 1."""
    clip_high: float = 0.2
    """PPO ratio clip above 1 (raise for DAPO-style clip-higher)."""
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = "token_mean"
    """How token losses make the batch's loss (VeRL's names)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to a frozen reference policy (0 disables the reference)."""
    filter_equal_reward_groups: bool = False
    """Drop prompt groups whose samples all got the same reward (no learning signal)."""
    tis_cap: float | None = None
    """Truncated importance sampling of the rollout engine's mismatch: each token's policy-gradient term weighed by
    min(p_train / p_rollout, tis_cap) (VeRL's rollout correction, slime's --use-tis; 2.0 is theirs), both before
    temperature and top-p: it corrects the engine's numerics, not the sampler's tempering. For bf16 or FP8 rollouts
    on a GPU; None (off) on CPU, where the engine agrees with the trainer to ~1e-6. With it, update/pg_loss is the
    weighted loss."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low < 1.0 or self.clip_high < 0.0:
            raise ConfigError(f"algorithm.clip_low must be in [0, 1) and clip_high >= 0, got {self.clip_low}, "
                              f"{self.clip_high}")
        check_choices(self, "algorithm")
        if self.tis_cap is not None and self.tis_cap < 1.0:
            raise ConfigError(f"algorithm.tis_cap must be >= 1 (or null: off), got {self.tis_cap}")


@dataclasses.dataclass(kw_only=True)
class OptimizerConfig:
    """Megatron's Adam."""

    lr: float = 1e-5
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to ``lr``: a fresh Adam's first steps are sign-like
    (every weight moves by ~lr whatever its gradient's noise), so ramping up keeps noise out of them."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """After the warm-up (to ``min_lr`` at the last step)."""
    min_lr: float = 0.0
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    distributed: bool = False
    """Megatron's distributed optimizer: fp32 master weights and Adam moments sharded over data-parallel
    ranks (ZeRO-1); checkpoints then hold one optimizer file per DP rank, so resume keeps the DP size."""

    def __post_init__(self) -> None:
        check_choices(self, "optimizer")
        if self.lr_warmup_steps < 0 or not 0.0 <= self.min_lr <= self.lr:
            raise ConfigError(f"optimizer.lr_warmup_steps must be >= 0 and 0 <= min_lr <= lr, got "
                              f"{self.lr_warmup_steps}, {self.min_lr}, {self.lr}")
