"""Rollout-engine input checks that must fire before any vLLM engine starts."""

import pytest
import torch

from megatron_tlt.formats.architecture import architecture_from_dict
from tiny_models import TINY_LLAMA, TINY_LLAMA_ROLLOUT, next_token_fixture
from megatron_tlt.spec.eagle import DrafterMismatch, validate_drafter
from megatron_tlt.spec.engine import (
    EngineError,
    RolloutEngine,
    RolloutEngineConfig,
    SpeculativeSettings,
    check_engine_supports,
)
from megatron_tlt.spec.metrics import SpecDecodeStats, acceptance_collapsed

ARCH = architecture_from_dict(TINY_LLAMA_ROLLOUT)


def _good_drafter():
    return dict(next_token_fixture(ARCH)["good_drafter"])


def test_a_drafter_of_another_hidden_size_is_refused_before_the_engine_starts(tmp_path):
    drafter = _good_drafter()
    drafter["fc.weight"] = torch.zeros(64, 128)
    with pytest.raises(DrafterMismatch, match=r"drafter hidden size does not match the policy: fc.weight is \(64, 128\)"):
        RolloutEngine(ARCH, RolloutEngineConfig(), workdir=tmp_path, rank=0,
                      speculative=SpeculativeSettings(), drafter=drafter)
    assert not list(tmp_path.iterdir())  # refused before anything was written or started


def test_a_drafter_with_another_vocabulary_is_refused():
    drafter = _good_drafter()
    drafter["embed_tokens.weight"] = torch.zeros(300, ARCH.hidden_size)
    with pytest.raises(DrafterMismatch, match=r"drafter vocabulary does not match the policy.*\(300, 128\)"):
        validate_drafter(ARCH, drafter)


def test_a_drafter_carrying_its_own_lm_head_or_missing_a_layer_tensor_is_refused():
    with pytest.raises(DrafterMismatch, match="shares the policy's LM head"):
        validate_drafter(ARCH, {**_good_drafter(), "lm_head.weight": torch.zeros(256, 128)})
    incomplete = _good_drafter()
    del incomplete["layers.0.mlp.down_proj.weight"]
    with pytest.raises(DrafterMismatch, match="missing tensors: layers.0.mlp.down_proj.weight"):
        validate_drafter(ARCH, incomplete)


def test_a_head_size_vllm_cpu_has_no_kernel_for_is_refused():
    if torch.cuda.is_available():
        pytest.skip("GPU vLLM supports this head size")
    with pytest.raises(EngineError, match="no attention kernel for head_dim 8"):
        check_engine_supports(architecture_from_dict(TINY_LLAMA))


def test_acceptance_statistics_and_the_collapse_rule():
    before = SpecDecodeStats(10, 30, 24, (9, 8, 7))
    after = SpecDecodeStats(30, 90, 25, (10, 8, 7))
    rollout = after - before
    assert rollout == SpecDecodeStats(20, 60, 1, (1, 0, 0))
    assert rollout.mean_acceptance_length == pytest.approx(1.05)
    assert acceptance_collapsed(rollout, threshold=0.05)
    assert not acceptance_collapsed(before, threshold=0.05)
    assert not acceptance_collapsed(SpecDecodeStats(), threshold=0.05)  # nothing proposed: no alarm
    # pooled over engines, one of them drafting shallower
    assert sum([rollout, SpecDecodeStats(5, 10, 4, (3, 1))], SpecDecodeStats()) == SpecDecodeStats(25, 70, 5, (4, 1, 0))
