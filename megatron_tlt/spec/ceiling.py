"""What speculation can buy at most with a given drafter: a ceiling from its held-out acceptance and its cost.

A speculative step at depth K drafts K tokens, then verifies K + 1 in one policy forward, and keeps
1 + sum_k prod_{j<=k} a_j tokens on average (a_j: the acceptance probability at draft step j given the steps
before it accepted, as ``drafter/quality.py`` measures it). Where verifying K + 1 tokens costs what decoding one
does (a memory-bound GPU at small batch: the best case for speculation) and a draft token costs the share c of a
policy token that the drafter's weights are of the policy's (its layer, its fc and the LM head it runs per draft
token), the step makes tokens at

    (1 + sum_{k<=K} prod_{j<=k} a_j) / (1 + c K)

times the rate of decoding without drafts. The ceiling is the best K's. It is a bound, not a forecast: a
compute-bound engine (a CPU, a GPU at large batch) pays for the K + 1 tokens it verifies, and the bandit then
keeps depth 0. A small policy with a large vocabulary pays most: SmolLM2-135M's LM head alone is a fifth of it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from megatron_tlt.formats.architecture import PolicyArchitecture
from megatron_tlt.plan.model import count_parameters, drafter_parameters


def drafter_cost_share(arch: PolicyArchitecture) -> float:
    """A draft token's matmul work over a policy token's: the drafter's layer and fc, and the LM head it runs per
    draft token, over the policy's weights (the embedding is a lookup, not a matmul: an untied one is left out; a
    tied one is the LM head, which both run)."""
    lm_head = arch.vocab_size * arch.hidden_size
    policy = count_parameters(arch) - (0 if arch.tie_word_embeddings else lm_head)
    return (drafter_parameters(arch) + lm_head) / policy


@dataclass(frozen=True)
class SpeculationCeiling:
    speedup: float
    """Tokens per second over decoding without drafts, at the best depth (1.0 at depth 0)."""
    depth: int
    """The depth that reaches it (0: no depth pays even when verifying is free)."""
    cost_share: float
    """A draft token's cost over a policy token's."""

    def describe(self) -> str:
        where = f"at depth {self.depth}" if self.depth else "at depth 0: no depth pays"
        return (f"speculation's ceiling with this drafter {self.speedup:.2f}x {where} (verifying free, a draft token "
                f"{self.cost_share:.0%} of a policy token)")


def speculation_ceiling(acceptance_by_position: Sequence[float], cost_share: float,
                        depths: Collection[int] | None = None) -> SpeculationCeiling | None:
    """The ceiling (module docstring) over ``depths`` (default: 0..len(acceptance_by_position)); depths past the
    measured positions are left out, and None is returned where no depth is left (a fixed depth past them)."""
    if cost_share < 0:
        raise ValueError(f"cost_share must be >= 0, got {cost_share}")
    allowed = set(range(len(acceptance_by_position) + 1)) if depths is None else set(depths)
    best, best_depth = (1.0, 0) if 0 in allowed else (None, None)
    tokens, reach = 1.0, 1.0
    for depth, accepted in enumerate(acceptance_by_position, start=1):
        if not 0.0 <= accepted <= 1.0:
            raise ValueError(f"acceptance at draft step {depth} must be in [0, 1], got {accepted}")
        reach *= accepted
        tokens += reach
        speedup = tokens / (1.0 + cost_share * depth)
        if depth in allowed and (best is None or speedup > best):
            best, best_depth = speedup, depth
    return None if best is None else SpeculationCeiling(best, best_depth, cost_share)
