import logging

import pytest

from megatron_tlt.formats.architecture import ModelConfigError, architecture_from_dict
from tiny_models import TINY_LLAMA, TINY_QWEN2


def test_llama_config_is_read_with_gqa_and_llama3_rope_scaling():
    arch = architecture_from_dict(TINY_LLAMA)
    assert (arch.family, arch.num_kv_heads, arch.head_dim, arch.heads_per_group) == ("llama", 4, 8, 2)
    assert arch.rope_scaling.factor == 8.0 and arch.rope_scaling.original_max_position_embeddings == 32
    assert not arch.qkv_bias and not arch.tie_word_embeddings


def test_transformers_v5_nested_rope_parameters_are_understood():
    cfg = {k: v for k, v in TINY_LLAMA.items() if k not in ("rope_scaling", "rope_theta")}
    cfg["rope_parameters"] = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "rope_theta": 5e5}
    arch = architecture_from_dict(cfg)
    assert arch.rope_theta == 5e5 and arch.rope_scaling.factor == 32.0


def test_qwen2_config_has_qkv_bias_and_tied_embeddings():
    arch = architecture_from_dict(TINY_QWEN2)
    assert arch.family == "qwen2" and arch.qkv_bias and arch.tie_word_embeddings and arch.rope_scaling is None


def test_padded_vocab_is_a_multiple_of_128_times_tp():
    arch = architecture_from_dict(TINY_LLAMA)
    assert arch.padded_vocab_size(1) == 256 and arch.padded_vocab_size(2) == 256 and arch.padded_vocab_size(4) == 512


@pytest.mark.parametrize(
    "tp, pp, message",
    [
        (3, 1, "tensor parallel size 3 does not divide num_attention_heads 8"),
        (8, 1, "tensor parallel size 8 does not divide num_key_value_heads 4"),
        (1, 8, "pipeline parallel size 8 is larger than num_hidden_layers 4"),
        (1, 3, "pipeline parallel size 3 does not divide num_hidden_layers 4"),
    ],
)
def test_impossible_layouts_are_refused_naming_the_values(tp, pp, message):
    with pytest.raises(ModelConfigError, match=message):
        architecture_from_dict(TINY_LLAMA).validate_layout(tensor_parallel_size=tp, pipeline_parallel_size=pp)


def test_unsupported_architecture_is_refused_by_name():
    with pytest.raises(ModelConfigError, match="unsupported architecture.*GPT2LMHeadModel"):
        architecture_from_dict({**TINY_LLAMA, "architectures": ["GPT2LMHeadModel"]})


@pytest.mark.parametrize("base, model_type, architecture", [(TINY_LLAMA, "llama", "LlamaForCausalLM"),
                                                         (TINY_QWEN2, "qwen2", "Qwen2ForCausalLM")])
def test_a_config_without_architectures_is_read_from_its_model_type_and_says_so(base, model_type, architecture,
                                                                               caplog):
    cfg = {k: v for k, v in base.items() if k != "architectures"} | {"model_type": model_type}
    with caplog.at_level(logging.INFO, logger="megatron_tlt.formats.architecture"):
        arch = architecture_from_dict(cfg, source="hf/config.json")
    assert arch.architecture == architecture and arch == architecture_from_dict(base)
    # every config.json written from it (engine, export, checkpoint metadata) names the class
    assert arch.hf_config["architectures"] == [architecture] and "architectures" not in cfg
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == f"hf/config.json: no 'architectures' list; model_type '{model_type}' read as {architecture}"
    caplog.clear()
    architecture_from_dict(arch.hf_config)  # read again (a checkpoint's metadata): nothing more to say
    assert not caplog.records


@pytest.mark.parametrize("model_type", ["gpt2", None])
def test_a_config_without_architectures_and_an_unknown_model_type_is_refused_naming_the_supported_ones(model_type):
    cfg = {k: v for k, v in TINY_LLAMA.items() if k != "architectures"} | {"model_type": model_type}
    with pytest.raises(ModelConfigError, match=rf"no 'architectures' list, and model_type {model_type!r} is not one we "
                                               r"support; supported: model_type \['llama', 'qwen2'\] \(architectures "
                                               r"\['LlamaForCausalLM', 'Qwen2ForCausalLM'\]\)"):
        architecture_from_dict(cfg)


def test_unsupported_rope_type_and_activation_are_refused():
    with pytest.raises(ModelConfigError, match="rope_scaling type 'yarn'"):
        architecture_from_dict({**TINY_LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ModelConfigError, match="hidden_act 'gelu'"):
        architecture_from_dict({**TINY_LLAMA, "hidden_act": "gelu"})


def test_layout_that_does_not_fit_the_world_is_refused_and_cleaned_up():
    import torch.distributed as dist

    from megatron_tlt.parallel import LayoutError, ParallelLayout

    with pytest.raises(LayoutError, match="world size 1 is not a multiple of tensor_parallel_size 2"):
        ParallelLayout(tensor_parallel_size=2).initialize()
    assert not dist.is_initialized()


def test_more_ranks_on_a_node_than_it_has_gpus_are_refused_in_words(monkeypatch):
    import torch

    from megatron_tlt.parallel import LayoutError, bind_local_gpu

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(LayoutError, match="local rank 1 has no GPU of its own: this node has 1; launch at most 1"):
        bind_local_gpu()
