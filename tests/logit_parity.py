"""Logit parity between a Megatron checkpoint and the HF model it came from.

The test suite runs it at TP=1, TP=2 and PP=2 (``dist/test_logit_parity.py``, and the GPU tests). The HF logits come
from transformers on the same rank, in fp32. A test helper, not part of the package: importable as ``logit_parity``
(pytest puts tests/ on the path).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from megatron_tlt.launcher import run_on_ranks

PARITY_TOLERANCE = 1e-4


@dataclasses.dataclass(frozen=True)
class ParityResult:
    model: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    max_abs_diff: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= PARITY_TOLERANCE


def _parity_on_rank(ckpt_dir: str, hf_dir: str, tp: int, pp: int, input_ids_bs: torch.Tensor) -> float | None:
    from megatron_tlt.model import policy
    from tiny_models import hf_logits
    from megatron_tlt.parallel import ParallelLayout

    with ParallelLayout(tensor_parallel_size=tp, pipeline_parallel_size=pp):
        model, meta = policy.load_policy_checkpoint(ckpt_dir)
        logits = policy.forward_logits(model, input_ids_bs, meta.arch.vocab_size)
        if logits is None:  # not the last pipeline stage
            return None
        return (logits.cpu() - hf_logits(hf_dir, input_ids_bs)).abs().max().item()  # transformers runs on the CPU


def megatron_vs_hf_max_abs_diff(ckpt_dir: str | Path, hf_dir: str | Path, *, tp: int, pp: int,
                                input_ids_bs: torch.Tensor) -> float:
    """Max |logit difference| over every position and vocabulary entry, at the given layout."""
    per_rank = run_on_ranks(_parity_on_rank, tp * pp, str(ckpt_dir), str(hf_dir), tp, pp, input_ids_bs)
    return max(v for v in per_rank.values() if v is not None)
