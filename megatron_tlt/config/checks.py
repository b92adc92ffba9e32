"""The configuration's error type, the checks sections share, and the keys that were removed."""

from __future__ import annotations

import dataclasses
import typing


class ConfigError(ValueError):
    """A configuration that cannot be loaded or does not make sense; the message says how to fix it."""


REMOVED_KEYS: dict[str, str] = {
    "drafter.speculative_tokens": "renamed drafter.depth (the speculation depth K; speculation.depths are the depths "
                                  "BEG-MAB picks among)",
    "drafter.spot_lr": "drafter.lr is now the online steps' rate (what spot_lr was); the cold start's is "
                       "drafter.cold_start.lr (what drafter.lr was)",
    "drafter.cold_start": "now a section: drafter.cold_start.enabled=true|false, beside its prompts, eval_prompts, "
                          "epochs, lr and eval_depth",
    "rollout.sampling_seed": "the rollouts' seeds derive from trainer.seed (the benchmarks that varied the "
                             "draws now compare arms on the same draws)",
    "trainer.capture_hidden_states": "the step captures the drafter's features exactly when the drafter "
                                     "trains or is measured in it (drafter.spot_training, drafter.quality_rows)",
    "drafter.features_from_every_group": "the groups the equal-reward filter drops gave the drafter no "
                                         "measurable gain for 13% of a step (bench/RESULTS.md, what was tried)",
    "drafter.average_adam_moments": "averaging Adam's moments with the replicas measured no gain; each rank "
                                    "keeps its own (bench/RESULTS.md, what was tried)",
    "drafter.spot_training_steps": "the spot trainer works in every step with drafter.spot_training=true; "
                                   "bench/spot_overhead.py compares runs with it on and off",
    "speculation.credit": "crediting shallower depths measured no gain (the loop's step 0.998x, SE 0.064: "
                          "bench/RESULTS.md, what was tried); BEG-MAB credits each depth its own reward",
    "speculation.context_bucket_bounds": "BEG-MAB per context-length bucket measured no gain (1.052x of one "
                                         "bucket, SE 0.055: bench/RESULTS.md, what was tried); it buckets by batch "
                                         "size alone",
}
"""Keys a user's YAML may still hold -> what to write instead (or why the option is gone): such a key fails with
this, not as an unknown key. bench/RESULTS.md's "what was tried" keeps the figures of the options removed."""


def choice_error(key: str, choices, value) -> str:
    return f"{key} must be one of {', '.join(map(str, choices))}, got '{value}'"


def check_choices(section: object, prefix: str) -> None:
    """Every field typed ``Literal[...]`` (or a list of them) holds one of its choices: the one check of every
    string choice. OmegaConf refuses a wrong value a YAML file or an override gives (``loading.py`` words its
    error the same way); this refuses one in a section made in code (``dataclasses.replace``)."""
    hints = typing.get_type_hints(type(section))
    for field in dataclasses.fields(section):
        hint, value = hints[field.name], getattr(section, field.name)
        values = [value]
        if typing.get_origin(hint) is list:
            hint, values = typing.get_args(hint)[0], list(value)
        if typing.get_origin(hint) is typing.Literal:
            for v in values:
                if v not in typing.get_args(hint):
                    raise ConfigError(choice_error(f"{prefix}.{field.name}", typing.get_args(hint), v))


def _require_at_least_one(section: str, **values: int) -> None:
    """Counts and sizes of which zero would leave nothing to run."""
    for name, value in values.items():
        if value < 1:
            raise ConfigError(f"{section}.{name} must be >= 1, got {value}")


def _require_divisible(key: str, value: int, parallel_key: str, parallel: int) -> None:
    """A total over all data-parallel ranks must split evenly, or ranks would disagree on their share."""
    if value % parallel:
        raise ConfigError(f"{key} {value} is not divisible by {parallel_key} {parallel}")


def _require_increasing(name: str, bounds: tuple[int, ...], what: str) -> None:
    for lo, hi in zip(bounds, bounds[1:]):
        if hi <= lo:
            raise ConfigError(f"{name} must be strictly increasing, got {lo} then {hi} in {list(bounds)}; {what} "
                              "would overlap.")
