"""The RL loop's settings and the whole tree, with the checks across its sections."""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

from megatron_tlt import layout_rules
from megatron_tlt.config.checks import ConfigError, _require_at_least_one, _require_divisible, check_choices
from megatron_tlt.config.drafter import DrafterConfig
from megatron_tlt.config.rollout import AlgorithmConfig, OptimizerConfig, RolloutConfig
from megatron_tlt.config.sections import DataConfig, ModelConfig, ParallelConfig, WarmupConfig
from megatron_tlt.config.speculation import SpeculationConfig
from megatron_tlt.model.build_options import Recompute

Logger = Literal["tensorboard", "wandb"]
LOGGERS = get_args(Logger)
"""Where the run's scalars may go (rl/run/metric_loggers.py opens each)."""


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
    recompute: Recompute = "none"
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
    run_dir: str | None = None
    """Where config, tensorboard events, checkpoints and summary.json go (None: runs/<time stamp>)."""
    loggers: list[Logger] = dataclasses.field(default_factory=lambda: ["tensorboard"])
    """Where the step scalars go, each getting the same ones: tensorboard (RUN_DIR/tensorboard), wandb
    (Weights & Biases, RUN_DIR/wandb), both ([tensorboard,wandb]) or none ([])."""
    wandb_mode: Literal["offline", "online"] = "offline"
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
        check_choices(self, "trainer")
        for name in self.loggers:
            if self.loggers.count(name) > 1:
                raise ConfigError(f"trainer.loggers lists '{name}' more than once")


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
        if self.speculation.adaptive and self.drafter.depth > 0:  # without speculation: nothing to pick
            _check_speculation_fits_drafter(self)


def _check_layout(config: TLTConfig) -> None:
    """The layout rules that need no model (``layout_rules``, shared with ``tlt plan``): the engine's TP
    divides the policy's, sequence parallelism has TP ranks to split over."""
    try:
        layout_rules.check_config_layout(config)
    except layout_rules.LayoutError as err:
        raise ConfigError(str(err)) from None


def _check_speculation_fits_drafter(config: TLTConfig) -> None:
    """BEG-MAB chooses among depths the engines are built for: up to drafter.depth."""
    config.speculation.arms(config.drafter.depth)
