import dataclasses
import re

import pytest

from megatron_tlt.config import (
    REMOVED_KEYS,
    AlgorithmConfig,
    ConfigError,
    DataConfig,
    DrafterConfig,
    ParallelConfig,
    RolloutConfig,
    SpeculationConfig,
    TLTConfig,
    TrainerConfig,
    load_config,
    to_yaml,
    valid_keys,
    world_size,
)


def test_defaults_then_named_config_then_overrides_apply_in_order():
    config = load_config("tiny", ["rollout.temperature=0.7", "trainer.steps=3", "parallel.tensor_parallel_size=2"])
    assert isinstance(config, TLTConfig)
    assert config.rollout.temperature == 0.7 and config.trainer.steps == 3
    assert config.optimizer.lr == 3e-4  # from launch/configs/tiny.yaml
    assert config.algorithm.clip_high == 0.2  # untouched default
    assert world_size(config) == 4


def test_an_unknown_key_is_refused_with_the_nearest_valid_keys():
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout.temprature'.*nearest valid keys: rollout.temperature"):
        load_config(None, ["rollout.temprature=0.5"])
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.stepz'.*trainer.steps"):
        load_config(None, ["trainer.stepz=5"])


def test_an_unknown_key_in_a_yaml_file_names_the_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("algorithm:\n  kl_coeff: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'algorithm.kl_coeff' in .*mine.yaml.*algorithm.kl_coef"):
        load_config(str(path))


@pytest.mark.parametrize("key", ["speculation.credit", "speculation.context_bucket_bounds"])
def test_a_removed_speculation_key_is_refused_with_why_it_went_in_an_override_or_a_yaml_file(key, tmp_path):
    value = {"speculation.credit": "own", "speculation.context_bucket_bounds": "[256, 512]"}[key]
    with pytest.raises(ConfigError, match=rf"config key '{key}' in the command line was removed: "
                                          rf"{re.escape(REMOVED_KEYS[key])}"):
        load_config("tiny", [f"{key}={value}"])
    path = tmp_path / "mine.yaml"
    section, name = key.split(".")
    path.write_text(f"{section}:\n  {name}: {value}\n")
    with pytest.raises(ConfigError, match=rf"config key '{key}' in .*mine.yaml was removed"):
        load_config(str(path))


def test_a_value_of_the_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"trainer.steps"):
        load_config(None, ["trainer.steps=many"])


def test_bad_names_and_malformed_overrides_are_refused():
    with pytest.raises(ConfigError, match=r"no config named 'huge'; available: .*tiny"):
        load_config("huge")
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["trainer.steps"])


@pytest.mark.parametrize("override, message", [
    ("trainer.prompts_per_step=15", "not divisible by parallel.data_parallel_size 2"),
    ("algorithm.clip_low=1.5", "clip_low must be in"),
    ("rollout.top_p=0", "top_p must be in"),
    ("parallel.tensor_parallel_size=0", "parallel.tensor_parallel_size must be >= 1"),
    ("model.dtype=float8", "model.dtype must be"),
    ("optimizer.lr_decay_style=exp", "optimizer.lr_decay_style must be one of constant, linear, cosine"),
    ("optimizer.min_lr=1", "0 <= min_lr <= lr"),
    ("warmup.other_answer_format_share=1.5", "other_answer_format_share must be in"),
    ("warmup.check_share=1.0", "check_share must be in \\[0, 1\\)"),
    ("model.tiny.max_position_embeddings=0", "max_position_embeddings"),
    ("model.tiny.num_attention_heads=3", "num_attention_heads 3 must divide hidden_size 128"),
    ("model.tiny.num_layers=0", "model.tiny.num_layers must be >= 1"),
    ("data.length_tail=0", "data.length_tail must be > 0"),
    ("data.solution_style=prose", "data.solution_style must be one of chain, restate"),
    ("data.max_solution_steps=0", "data.max_solution_steps must be >= 1"),
    ("model.attention=flash", "model.attention must be one of sdpa, local, te"),
    ("trainer.recompute=partial", "trainer.recompute must be one of none, selective, full"),
    ("parallel.sequence_parallel=true", "sequence_parallel needs parallel.tensor_parallel_size > 1"),
    ("model.attention=te", "needs Transformer Engine, which is not installed here"),
])
def test_inconsistent_values_are_refused_at_load(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_the_resolved_config_round_trips_through_yaml(tmp_path):
    config = load_config("tiny", ["optimizer.lr=3e-4"])
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(config))
    again = load_config(str(path))
    assert again == config


@pytest.mark.parametrize("overrides, message", [
    (["speculation.adaptive=true", "drafter.depth=3", "speculation.bucket_bounds=[1,5,5]"],
     r"speculation.bucket_bounds must be strictly increasing, got 5 then 5 .* the buckets would overlap"),
    (["speculation.adaptive=true", "drafter.depth=3", "speculation.depths=[0,2,4]"],
     r"speculation.depths has 4, above the engine's maximum speculation depth max_depth=3"),
    (["speculation.adaptive=true", "drafter.depth=3", "speculation.epsilon=1.5"],
     r"speculation.epsilon must be in \[0, 1\], got 1.5"),
    (["speculation.adaptive=true", "drafter.depth=3", "speculation.epsilon=-0.1"],
     r"speculation.epsilon must be in \[0, 1\]"),
    (["drafter.unroll_steps=0"], r"drafter.unroll_steps must be >= 1 \(1: no unrolling\), got 0"),
    (["drafter.schedule=after"], r"drafter.schedule must be one of idle, serial, got 'after'"),
    (["drafter.spot_training=true", "drafter.schedule=serial"],
     r"drafter.schedule=serial .* needs drafter.spot_training=true and drafter.serial_tokens >= 1, got "
     r"spot_training=true, serial_tokens=0"),
    (["drafter.depth=3", "speculation.draft_sampling=sampled"],
     r"speculation.draft_sampling must be one of probabilistic, greedy, got 'sampled'"),
])
def test_bad_bandit_settings_are_refused_at_start_up(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_the_bandit_takes_the_speculation_section_with_every_depth_up_to_the_engines_by_default():
    from megatron_tlt.spec.bandit import BucketedEpsilonGreedy

    config = load_config(None, ["speculation.adaptive=true", "drafter.depth=3"])
    settings = config.speculation
    assert settings.depths is None and settings.arms(config.drafter.depth) == (0, 1, 2, 3)
    assert settings.bucket_bounds == [1, 2, 5, 21, 32] and settings.max_speculative_batch is None
    bandit = BucketedEpsilonGreedy(settings, max_depth=config.drafter.depth, seed=config.trainer.seed)
    assert bandit.summary()["1"]["pulls"] == {"0": 0, "1": 0, "2": 0, "3": 0}
    assert not load_config(None, []).speculation.adaptive  # off by default: the engines get no bandit


def test_other_arms_are_a_replace_of_the_section_and_are_checked_again():
    speculation = load_config(None, []).speculation
    chosen = dataclasses.replace(speculation, adaptive=True, depths=[0, 1, 2])
    assert chosen.arms(max_depth=4) == (0, 1, 2)
    with pytest.raises(ConfigError, match=r"speculation.depths has duplicate values \[1\]"):
        dataclasses.replace(speculation, depths=[0, 1, 1])
    with pytest.raises(ConfigError, match="speculation.depths has 2, above the engine's maximum speculation depth "
                                          "max_depth=1"):
        chosen.arms(max_depth=1)


@pytest.mark.parametrize("build, message", [
    (lambda: ParallelConfig(data_parallel_size=0), "parallel.data_parallel_size must be >= 1, got 0"),
    (lambda: TrainerConfig(micro_batch_size=0), "trainer.micro_batch_size must be >= 1, got 0"),
    (lambda: RolloutConfig(top_p=1.5), r"rollout.top_p must be in \(0, 1\]"),
    (lambda: AlgorithmConfig(advantage="ppo"), "algorithm.advantage must be one of grpo, rloo, got 'ppo'"),
    (lambda: DrafterConfig(precision="fp4"), "drafter.precision must be one of auto, fp32, bf16, fp8, got 'fp4'"),
    (lambda: SpeculationConfig(window=10, median_blocks=11),
     r"speculation.median_blocks must be in \[1, window=10\], got 11"),
    (lambda: DataConfig(reward_workers=-1), r"data.reward_workers must be >= 0 \(0: score inline\), got -1"),
    (lambda: DataConfig(reward_timeout_s=0.0), "data.reward_timeout_s must be > 0 seconds, got 0.0"),
    (lambda: DataConfig(reward_failure_value=float("nan")), "data.reward_failure_value must be a finite number"),
])
def test_each_section_checks_its_own_values_when_it_is_built(build, message):
    """A section made in code (a test, a benchmark, dataclasses.replace) is checked like a loaded one."""
    with pytest.raises(ConfigError, match=message):
        build()


@pytest.mark.parametrize("override, message", [
    ("trainer.micro_batch_size=0", "trainer.micro_batch_size must be >= 1, got 0"),
    ("trainer.prompts_per_step=15", "trainer.prompts_per_step 15 is not divisible by parallel.data_parallel_size 2"),
    ("speculation.window=0", "speculation.window must be >= 1 reward, got 0"),
])
def test_load_config_raises_a_plain_config_error_from_the_sections_checks(override, message):
    """OmegaConf builds the dataclasses from the merged values and wraps only TypeErrors: the section's own
    ConfigError reaches the caller as it was raised, not inside an OmegaConf exception."""
    with pytest.raises(ConfigError, match=message) as info:
        load_config(None, [override])
    assert type(info.value) is ConfigError and str(info.value).startswith(override.split("=")[0])


def test_the_advantage_choices_are_the_registered_estimators():
    from megatron_tlt.config import ADVANTAGES
    from megatron_tlt.rl.advantages import known_advantage_names

    assert sorted(ADVANTAGES) == known_advantage_names()


def test_the_config_imports_no_component():
    """The bottom layer: rl, spec and drafter import config, never the other way round (not even lazily)."""
    import ast
    from pathlib import Path

    import megatron_tlt.config as config_module

    tree = ast.parse(Path(config_module.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    components = ("megatron_tlt.rl", "megatron_tlt.spec", "megatron_tlt.drafter")
    assert not [name for name in imported if name.startswith(components)], imported


def test_help_config_prints_every_key_with_its_type_default_and_docstring(capsys):
    from megatron_tlt.cli import main

    assert main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out
    for key in valid_keys():
        assert f"  {key} (" in out, key
    # what `tlt train` runs, and the field's own default where tiny.yaml sets another
    assert "  rollout.temperature (float; `tlt train`: 1.0)" in out
    assert "  drafter.depth (int; `tlt train`: 8; field default 0)" in out
    assert "  speculation.depths (list[int] | None; `tlt train`: null)" in out
    assert "The arms (depths K, 0 = off); null: every depth 0..drafter.depth, written into the run's" in out
    assert "  drafter.schedule (Literal['idle', 'serial']; `tlt train`: idle)" in out
    assert "GRPO group size n." in out and "\nspeculation: BEG-MAB" in out


def test_the_build_keys_become_the_policy_build_options():
    from megatron_tlt.config import build_options
    from megatron_tlt.model.build_options import BuildOptions

    assert build_options(load_config(None)) == BuildOptions(attention="sdpa", recompute="none", sequence_parallel=False)
    config = load_config(None, ["model.attention=local", "trainer.recompute=selective",
                                "parallel.tensor_parallel_size=2", "parallel.data_parallel_size=1",
                                "parallel.sequence_parallel=true", "optimizer.distributed=true"])
    assert build_options(config) == BuildOptions(attention="local", recompute="selective", sequence_parallel=True)
    assert config.optimizer.distributed


def test_tlt_is_on_in_the_tiny_default_and_two_overrides_turn_it_off():
    on = load_config("tiny")
    assert on.drafter.depth > 0 and on.drafter.spot_training and on.drafter.cold_start.enabled
    assert on.speculation.adaptive
    off = load_config("tiny", ["drafter.depth=0", "drafter.spot_training=false"])
    assert off.drafter.depth == 0 and not off.drafter.spot_training


def test_model_hf_dir_without_a_config_picks_the_pretrained_config_and_says_so():
    from megatron_tlt.config import config_name_for

    assert config_name_for(None, ["trainer.steps=2"]) == ("tiny", None)
    name, note = config_name_for(None, ["model.hf_dir=/models/mine", "trainer.steps=2"])
    assert name == "hf" and note.startswith("model.hf_dir is set: using --config hf")
    assert config_name_for("tiny", ["model.hf_dir=/models/mine"]) == ("tiny", None)  # asked for: kept


def test_the_pretrained_config_holds_rl_settings_for_a_pretrained_model_and_needs_one():
    from megatron_tlt.config import check_pretrained_config

    config = load_config("hf", ["model.hf_dir=/models/mine"])
    assert config.optimizer.lr == 1e-6 and config.algorithm.kl_coef == 0.001
    assert (config.rollout.samples_per_prompt, config.rollout.max_response_tokens) == (8, 1024)
    assert config.drafter.cold_start.enabled and config.drafter.spot_training and config.speculation.adaptive
    check_pretrained_config("hf", config)
    with pytest.raises(ConfigError, match="--config hf trains a pretrained model: set model.hf_dir=DIR"):
        check_pretrained_config("hf", load_config("hf"))
    check_pretrained_config("tiny", load_config("tiny"))


def test_the_cold_start_is_a_config_section_the_tiny_default_and_a_pretrained_policy_size_for_their_prompts():
    tiny = load_config("tiny").drafter.cold_start
    assert (tiny.prompts, tiny.eval_prompts, tiny.epochs, tiny.lr, tiny.eval_depth) == (4096, 128, 16, 3e-3, 6)
    pretrained = load_config("hf", ["model.hf_dir=/models/mine"]).drafter.cold_start
    assert (pretrained.prompts, pretrained.eval_prompts, pretrained.epochs, pretrained.lr, pretrained.eval_depth,
            pretrained.max_response_tokens) == (32, 16, 4, 1e-3, 4, 256)
    assert tiny.max_response_tokens is None  # the rollout's cap


@pytest.mark.parametrize("old, message", [
    ("drafter.cold_start=true", "now a section: drafter.cold_start.enabled=true|false"),
    ("drafter.spot_lr=1e-4", "drafter.lr is now the online steps' rate"),
    ("drafter.speculative_tokens=4", "renamed drafter.depth"),
])
def test_a_key_that_was_renamed_or_became_a_section_names_what_to_write_now(old, message):
    with pytest.raises(ConfigError, match=rf"config key '{old.split('=')[0]}' in the command line was removed: "
                                          rf"{re.escape(message)}"):
        load_config("tiny", [old])
