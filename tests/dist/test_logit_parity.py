"""Megatron (converted with tlt convert at TP=2) vs transformers logits, at TP=1, TP=2 and PP=2.

Each layout runs as real ranks (torch elastic launch, gloo) on this machine.
"""

import pytest

from logit_parity import PARITY_TOLERANCE, megatron_vs_hf_max_abs_diff

LAYOUTS = [(1, 1), (2, 1), (1, 2)]


@pytest.mark.parametrize("tp, pp", LAYOUTS, ids=["tp1", "tp2", "pp2"])
def test_llama_logits_match_transformers(tp, pp, llama_mcore_tp2, tiny_llama_dir, sample_input_ids):
    diff = megatron_vs_hf_max_abs_diff(llama_mcore_tp2, tiny_llama_dir, tp=tp, pp=pp, input_ids_bs=sample_input_ids)
    assert diff < PARITY_TOLERANCE


@pytest.mark.parametrize("tp, pp", LAYOUTS, ids=["tp1", "tp2", "pp2"])
def test_qwen2_logits_match_transformers(tp, pp, qwen2_mcore_tp2, tiny_qwen2_dir, sample_input_ids):
    diff = megatron_vs_hf_max_abs_diff(qwen2_mcore_tp2, tiny_qwen2_dir, tp=tp, pp=pp, input_ids_bs=sample_input_ids)
    assert diff < PARITY_TOLERANCE
