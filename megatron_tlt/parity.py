"""Logit parity between a Megatron checkpoint and the HF model it came from.

``tlt train`` runs this check until the RL loop exists; the test suite runs it at TP=1, TP=2
and PP=2. The HF logits come from transformers on the same rank, in fp32.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Iterator
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
    from megatron_tlt import policy
    from megatron_tlt.parallel import ParallelLayout
    from megatron_tlt.tiny_models import hf_logits

    with ParallelLayout(tensor_parallel_size=tp, pipeline_parallel_size=pp):
        model, meta = policy.load_policy_checkpoint(ckpt_dir)
        logits = policy.forward_logits(model, input_ids_bs, meta.arch.vocab_size)
        if logits is None:  # not the last pipeline stage
            return None
        return (logits - hf_logits(hf_dir, input_ids_bs)).abs().max().item()


def megatron_vs_hf_max_abs_diff(ckpt_dir: str | Path, hf_dir: str | Path, *, tp: int, pp: int,
                                input_ids_bs: torch.Tensor) -> float:
    """Max |logit difference| over every position and vocabulary entry, at the given layout."""
    per_rank = run_on_ranks(_parity_on_rank, tp * pp, str(ckpt_dir), str(hf_dir), tp, pp, input_ids_bs)
    return max(v for v in per_rank.values() if v is not None)


def run_parity_check(workdir: str | Path | None = None) -> Iterator[ParityResult]:
    """Tiny random Llama and Qwen2 -> ``tlt convert`` (TP=2) -> logits at TP=1, TP=2, PP=2.

    Yields each result as soon as it is measured.
    """
    from checkpoints_tools.hf_to_mcore import convert_hf_to_mcore
    from megatron_tlt.tiny_models import TINY_LLAMA, TINY_QWEN2, make_tiny_hf_model

    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for name, config in (("llama", TINY_LLAMA), ("qwen2", TINY_QWEN2)):
            hf_dir = make_tiny_hf_model(Path(tmp) / name, config)
            ckpt = convert_hf_to_mcore(hf_dir, Path(tmp) / f"{name}-mcore", tp=2)
            ids = torch.randint(0, config["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
            for tp, pp in ((1, 1), (2, 1), (1, 2)):
                diff = megatron_vs_hf_max_abs_diff(ckpt, hf_dir, tp=tp, pp=pp, input_ids_bs=ids)
                yield ParityResult(name, tp, pp, diff)
