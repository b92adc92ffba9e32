"""Speculative-decoding statistics of a rollout, and the rule that calls acceptance collapsed.

Pure: vLLM's cumulative counters go in, per-rollout differences and derived rates come out.
"""

from __future__ import annotations

import dataclasses
import itertools


@dataclasses.dataclass(frozen=True)
class SpecDecodeStats:
    """Speculative-decoding counts of one rollout (vLLM's counters, as differences)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float:
        """Accepted share of proposed draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per target step: the accepted drafts plus the target's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def __add__(self, other: "SpecDecodeStats") -> "SpecDecodeStats":
        """Pooled counts (several engines or rollouts): ``sum(stats, SpecDecodeStats())``."""
        per_pos = tuple(a + b for a, b in itertools.zip_longest(self.accepted_per_position, other.accepted_per_position,
                                                                fillvalue=0))
        return SpecDecodeStats(self.num_drafts + other.num_drafts, self.num_draft_tokens + other.num_draft_tokens,
                               self.num_accepted_tokens + other.num_accepted_tokens, per_pos)

    def __sub__(self, earlier: "SpecDecodeStats") -> "SpecDecodeStats":
        per_pos = tuple(a - b for a, b in zip(self.accepted_per_position,
                                              earlier.accepted_per_position or (0,) * len(self.accepted_per_position)))
        return SpecDecodeStats(self.num_drafts - earlier.num_drafts, self.num_draft_tokens - earlier.num_draft_tokens,
                               self.num_accepted_tokens - earlier.num_accepted_tokens, per_pos)


def acceptance_collapsed(stats: SpecDecodeStats, threshold: float) -> bool:
    """True when drafts were proposed and (almost) none were accepted."""
    return stats.num_draft_tokens > 0 and stats.acceptance_rate < threshold
