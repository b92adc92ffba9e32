"""The per-rank timeline: what each rank did, and when, in every RL step.

Each rank records spans (phase, state, start, end) on the wall clock; ``state`` is BUSY, IDLE or,
while the spot trainer runs drafter steps in the rollout long tail, TRAINING. Rollout is the phase where ranks diverge: a rank
is BUSY while its own engine generates and IDLE from the moment its share is done until the slowest
rank finishes (the barrier that closes the phase). That idle time is what TLT puts to use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

BUSY, IDLE, TRAINING = "BUSY", "IDLE", "TRAINING"
PHASES = ("rollout", "reward", "logprob", "update", "sync")


@dataclasses.dataclass(frozen=True)
class Span:
    phase: str
    state: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclasses.dataclass
class RankTimeline:
    """One rank's spans in one step."""

    rank: int
    spans: list[Span] = dataclasses.field(default_factory=list)

    def add(self, phase: str, state: str, start: float, end: float) -> None:
        self.spans.append(Span(phase, state, start, end))

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time a collective phase: the whole span counts as BUSY."""
        start = time.time()
        try:
            yield
        finally:
            self.add(name, BUSY, start, time.time())

    def seconds(self, phase: str, state: str | None = None) -> float:
        return sum(s.seconds for s in self.spans if s.phase == phase and (state is None or s.state == state))

    def to_records(self, step: int) -> list[dict]:
        return [dict(step=step, rank=self.rank, **dataclasses.asdict(s)) for s in self.spans]


def rollout_idle_seconds(timeline: RankTimeline) -> float:
    """Rollout time this rank was not generating: IDLE plus, with the spot trainer, TRAINING."""
    return timeline.seconds("rollout") - timeline.seconds("rollout", BUSY)


def rollout_idle_shares(timelines: list[RankTimeline]) -> list[float]:
    """Per rank, the share of the rollout phase it was not generating (0 for the slowest rank):
    the time TLT can use, whether the spot trainer used it (TRAINING) or not (IDLE)."""
    shares = []
    for timeline in timelines:
        total = timeline.seconds("rollout")
        shares.append(rollout_idle_seconds(timeline) / total if total > 0 else 0.0)
    return shares
