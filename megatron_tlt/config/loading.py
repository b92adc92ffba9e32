"""Loading a config by name or path with dotted overrides: the error a user sees for each mistake."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from megatron_tlt.config.checks import REMOVED_KEYS, ConfigError, choice_error
from megatron_tlt.config.run import TLTConfig
from megatron_tlt.model.build_options import BuildOptions

CONFIG_DIR = Path(__file__).resolve().parents[2] / "launch" / "configs"


def _dotted_keys(node: Any, prefix: str = "") -> list[str]:
    """The dotted leaf keys of a config tree: the whole schema, one YAML file or the overrides."""
    keys = []
    for name in node.keys():
        child = node._get_node(name)
        keys.extend(_dotted_keys(child, f"{prefix}{name}.") if OmegaConf.is_dict(child) else [f"{prefix}{name}"])
    return keys


def valid_keys() -> list[str]:
    return _dotted_keys(OmegaConf.structured(TLTConfig))


def _unknown_key_error(err: ConfigKeyError, source: str) -> ConfigError:
    key = getattr(err, "full_key", None) or str(err).split("'")[1]
    nearest = difflib.get_close_matches(key, valid_keys(), n=3, cutoff=0.5)
    if not nearest:  # a misspelt leaf under a valid section: match the leaf name alone
        leaf = key.rsplit(".", 1)[-1]
        nearest = [k for k in valid_keys() if difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1]], cutoff=0.6)][:3]
    hint = f"; nearest valid keys: {', '.join(nearest)}" if nearest else "; see `tlt train --help-config`"
    return ConfigError(f"unknown config key '{key}' in {source}{hint}")


def _refuse_removed_keys(layer: Any, source: str) -> None:
    for key in _dotted_keys(layer):
        if key in REMOVED_KEYS:
            raise ConfigError(f"config key '{key}' in {source} was removed: {REMOVED_KEYS[key]}")


def _value_error(err: OmegaConfBaseException, source: str) -> ConfigError:
    """A value OmegaConf refused: a choice not among a ``Literal``'s is worded as ``checks.check_choices`` words it."""
    first, key = str(err).splitlines()[0], getattr(err, "full_key", "?")
    choice = re.fullmatch(r"Invalid value '(.*)', expected one of \[(.*)\]", first)
    if choice:
        choices = [c.strip().strip("'") for c in choice.group(2).split(",")]
        return ConfigError(f"{source}: {choice_error(key, choices, choice.group(1))}")
    return ConfigError(f"{source}: {first} (key '{key}')")


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
        _refuse_removed_keys(layer, source)
        try:
            merged = OmegaConf.merge(merged, layer)
        except ConfigKeyError as err:
            raise _unknown_key_error(err, source) from None
        except OmegaConfBaseException as err:
            raise _value_error(err, source) from None
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
