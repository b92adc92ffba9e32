"""HF -> Megatron (TP=2) -> HF is bit-exact; checkpoints written at one layout load at another."""

import json

import torch
from transformers import AutoModelForCausalLM

from checkpoints_tools.hf_to_mcore import convert_hf_to_mcore
from checkpoints_tools.mcore_to_hf import convert_mcore_to_hf
from megatron_tlt.formats.hf_io import HFCheckpointReader
from logit_parity import megatron_vs_hf_max_abs_diff


def _assert_bit_exact(original_dir, exported_dir):
    before, after = HFCheckpointReader(original_dir), HFCheckpointReader(exported_dir)
    assert sorted(before.names()) == sorted(after.names())
    for name in before.names():
        a, b = before.get(name), after.get(name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_llama_round_trip_through_tp2_is_bit_exact(llama_mcore_tp2, tiny_llama_dir, tmp_path):
    out = convert_mcore_to_hf(llama_mcore_tp2, tmp_path / "llama-hf")
    _assert_bit_exact(tiny_llama_dir, out)
    # The export is a model directory transformers loads as-is.
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert json.loads((out / "config.json").read_text())["rope_parameters"]["rope_type"] == "llama3"


def test_qwen2_sharded_tied_round_trip_through_tp2_is_bit_exact(qwen2_mcore_tp2, tiny_qwen2_dir, tmp_path):
    out = convert_mcore_to_hf(qwen2_mcore_tp2, tmp_path / "qwen2-hf", max_shard_size="100KB")
    assert (out / "model.safetensors.index.json").is_file()
    _assert_bit_exact(tiny_qwen2_dir, out)


def test_checkpoint_written_at_pp2_loads_at_tp2(tiny_llama_dir, tmp_path, sample_input_ids):
    ckpt = convert_hf_to_mcore(tiny_llama_dir, tmp_path / "llama-pp2", pp=2)
    assert megatron_vs_hf_max_abs_diff(ckpt, tiny_llama_dir, tp=2, pp=1, input_ids_bs=sample_input_ids) < 1e-4
