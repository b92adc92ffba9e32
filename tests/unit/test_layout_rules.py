"""One rule book for layouts: ``tlt train`` (``load_config``, ``layout_rules.check_run_layout``) and ``tlt plan``
(``plan.plan_layout``, ``plan_cli``) refuse the same bad layouts with the same sentence."""

from __future__ import annotations

import json

import pytest

from megatron_tlt import layout_rules
from megatron_tlt.config import ConfigError, load_config
from megatron_tlt.formats.architecture import ModelConfigError, architecture_from_dict
from megatron_tlt.layout_rules import LayoutError, check_run_layout
from megatron_tlt.plan import cli as plan_cli
from megatron_tlt.plan import search as P
from megatron_tlt.plan.model import PlanError

# 8 heads, 4 KV heads, 4 layers; intermediate_size 170 is divisible by 2 but not by 4
MODEL = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64,
             intermediate_size=170, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
ARCH = architecture_from_dict(MODEL)

# (what is wrong, the config's overrides, the planner's tp/pp/PlanOptions, the rule book's sentence)
MODEL_RULES = [
    ("tp-not-dividing-heads", dict(tp=3, pp=1), "tensor parallel size 3 does not divide num_attention_heads 8"),
    ("tp-not-dividing-kv-heads", dict(tp=8, pp=1), "tensor parallel size 8 does not divide num_key_value_heads 4"),
    ("tp-not-dividing-intermediate-size", dict(tp=4, pp=1),
     "tensor parallel size 4 does not divide intermediate_size 170"),
    ("pp-not-dividing-layers", dict(tp=1, pp=3), "pipeline parallel size 3 does not divide num_hidden_layers 4"),
]
CONFIG_RULES = [
    ("engine-tp-not-dividing-policy-tp", dict(tp=2, pp=1, engine_tp=4),
     "rollout.engine.tensor_parallel_size 4 must be >= 1 and divide parallel.tensor_parallel_size 2"),
    ("sequence-parallel-at-tp-1", dict(tp=1, pp=1, sequence_parallel=True),
     "parallel.sequence_parallel needs parallel.tensor_parallel_size > 1, got 1"),
]


def _overrides(tp: int, pp: int, engine_tp: int | None = None, sequence_parallel: bool = False) -> list[str]:
    overrides = [f"parallel.tensor_parallel_size={tp}", f"parallel.pipeline_parallel_size={pp}",
                 "parallel.data_parallel_size=1"]
    if engine_tp is not None:
        overrides.append(f"rollout.engine.tensor_parallel_size={engine_tp}")
    if sequence_parallel:
        overrides.append("parallel.sequence_parallel=true")
    return overrides


def _planner_message(tp: int, pp: int, engine_tp: int | None = None, sequence_parallel: bool = False) -> str:
    options = P.PlanOptions(seq_len=256, engine_tp=engine_tp, sequence_parallel=sequence_parallel)
    with pytest.raises(PlanError) as info:
        P.plan_layout(ARCH, nodes=1, gpus_per_node=8, tp=tp, pp=pp, options=options)
    return str(info.value)


def _planner_cli_message(capsys, tmp_path, tp: int, pp: int, engine_tp: int | None = None,
                         sequence_parallel: bool = False) -> str:
    model = tmp_path / "config.json"
    model.write_text(json.dumps(MODEL))
    args = ["--model", str(model), "--nodes", "1", "--gpus-per-node", "8", "--tp", str(tp), "--pp", str(pp),
            "--seq-len", "256"]
    args += ["--engine-tp", str(engine_tp)] if engine_tp is not None else []
    args += ["--sequence-parallel"] if sequence_parallel else []
    assert plan_cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("tlt plan: error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("layout, sentence", [case[1:] for case in MODEL_RULES], ids=[c[0] for c in MODEL_RULES])
def test_the_trainer_and_the_planner_refuse_a_layout_the_model_cannot_take_with_one_sentence(
        layout, sentence, capsys, tmp_path):
    config = load_config(None, _overrides(**layout))  # a model rule: the config alone is fine
    with pytest.raises(LayoutError) as trainer:
        check_run_layout(config, ARCH)
    assert sentence in str(trainer.value)
    assert str(trainer.value) in _planner_message(**layout)
    assert str(trainer.value) in _planner_cli_message(capsys, tmp_path, **layout)


@pytest.mark.parametrize("layout, sentence", [case[1:] for case in CONFIG_RULES], ids=[c[0] for c in CONFIG_RULES])
def test_the_trainer_and_the_planner_refuse_a_layout_no_model_can_take_with_one_sentence(
        layout, sentence, capsys, tmp_path):
    with pytest.raises(ConfigError) as trainer:  # needs no model: refused as the config loads
        load_config(None, _overrides(**layout))
    assert sentence in str(trainer.value)
    assert str(trainer.value) in _planner_message(**layout)
    assert str(trainer.value) in _planner_cli_message(capsys, tmp_path, **layout)


def test_a_layout_the_model_takes_passes_both():
    config = load_config(None, _overrides(tp=2, pp=2, engine_tp=1))
    check_run_layout(config, ARCH)
    plan = P.plan_layout(ARCH, nodes=1, gpus_per_node=8, tp=2, pp=2, options=P.PlanOptions(seq_len=256, engine_tp=1))
    assert (plan.dp, plan.engine_tp) == (2, 1)


def test_the_architectures_own_check_is_the_rule_book():
    """``PolicyArchitecture.validate_layout`` (the converter, the policy builder) delegates to the book."""
    with pytest.raises(ModelConfigError, match="tensor parallel size 4 does not divide intermediate_size 170"):
        ARCH.validate_layout(tensor_parallel_size=4, pipeline_parallel_size=1)
    ARCH.validate_layout(tensor_parallel_size=2, pipeline_parallel_size=4)


def test_an_engine_may_replicate_kv_heads_in_whole_copies_but_must_split_the_attention_heads():
    layout_rules.check_engine_model(architecture_from_dict(dict(MODEL, intermediate_size=192)),
                                    engine_tp=8)  # 4 KV heads, each on 2 of 8 ranks
    narrow = architecture_from_dict(dict(MODEL, num_attention_heads=12, num_key_value_heads=3, intermediate_size=192))
    with pytest.raises(LayoutError, match="engine tensor parallel size 2 must divide, or be a multiple of, "
                                          "num_key_value_heads 3"):
        layout_rules.check_engine_model(narrow, engine_tp=2)
    with pytest.raises(LayoutError, match="engine tensor parallel size 8 does not divide num_attention_heads 12"):
        layout_rules.check_engine_layout(engine_tp=8, policy_tp=8, arch=narrow)
