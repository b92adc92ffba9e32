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

from megatron_tlt.config.checks import REMOVED_KEYS, ConfigError
from megatron_tlt.config.drafter import DRAFTER_PRECISIONS, ColdStartConfig, DrafterConfig
from megatron_tlt.config.loading import (CONFIG_DIR, DEFAULT_CONFIG, PRETRAINED_CONFIG, build_options,
                                         check_pretrained_config, config_name_for, load_config, to_yaml, valid_keys,
                                         world_size)
from megatron_tlt.config.reference import describe_keys
from megatron_tlt.config.rollout import ADVANTAGES, AlgorithmConfig, OptimizerConfig, RolloutConfig, RolloutEngineConfig
from megatron_tlt.config.run import LOGGERS, TLTConfig, TrainerConfig
from megatron_tlt.config.sections import DataConfig, ModelConfig, ParallelConfig, TinyPolicyConfig, WarmupConfig
from megatron_tlt.config.speculation import SpeculationConfig

__all__ = [
    "ADVANTAGES", "CONFIG_DIR", "DEFAULT_CONFIG", "DRAFTER_PRECISIONS", "LOGGERS", "PRETRAINED_CONFIG", "REMOVED_KEYS",
    "AlgorithmConfig", "ColdStartConfig", "ConfigError", "DataConfig", "DrafterConfig", "ModelConfig", "OptimizerConfig",
    "ParallelConfig", "RolloutConfig", "RolloutEngineConfig", "SpeculationConfig", "TLTConfig", "TinyPolicyConfig",
    "TrainerConfig", "WarmupConfig", "build_options", "check_pretrained_config", "config_name_for", "describe_keys",
    "load_config", "to_yaml", "valid_keys", "world_size",
]
