"""Which batch sizes may run speculative shapes: the table vLLM sizes its CUDA-graph pool from.

With dynamic speculation vLLM reads ``num_speculative_tokens_per_batch_size`` twice: the scheduler's
per-batch depth (which our BEG-MAB scheduler overrides step by step) and the capture tiers of its CUDA
graphs: decode graphs of query length K + 1 are captured only up to the widest batch that table gives
depth K. Batches above ``speculation.max_speculative_batch`` never speculate, so the table gives them
depth 0 and vLLM captures only one-token decode graphs there; a static depth would capture (K + 1)-token
graphs for every batch size up to ``max_num_seqs`` (the memory-efficient graph pool of TLT).
"""

from __future__ import annotations

from megatron_tlt.config import SpeculationConfig


def speculative_batch_limit(settings: SpeculationConfig, max_depth: int, max_num_seqs: int) -> int:
    """Largest batch size at which the bandit may choose a depth above 0 (0: never speculates)."""
    if max(settings.arms(max_depth)) == 0:
        return 0
    limit = settings.max_speculative_batch if settings.max_speculative_batch is not None else max_num_seqs
    return min(limit, max_num_seqs)


def speculation_schedule(settings: SpeculationConfig, max_depth: int, max_num_seqs: int) -> list[tuple[int, int, int]]:
    """vLLM's ``num_speculative_tokens_per_batch_size``: (first batch, last batch, depth) ranges; the arms
    are ``settings``' over an engine built for ``max_depth`` (``SpeculationConfig.arms``)."""
    depth = max(settings.arms(max_depth))
    limit = speculative_batch_limit(settings, max_depth, max_num_seqs)
    if limit == 0 or depth == 0:
        return [(1, max_num_seqs, 0)]
    schedule = [(1, limit, depth)]
    if limit < max_num_seqs:
        schedule.append((limit + 1, max_num_seqs, 0))
    return schedule
