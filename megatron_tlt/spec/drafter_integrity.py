"""Drafter integrity at every hand-over: does the rollout engine hold the drafter the trainer meant?

Peers lost drafter weights silently in weight syncs and engine wakes (DESIGN.md section 4); the acceptance
alarm (``RolloutEngine.check_acceptance``) notices only once acceptance has collapsed, and not a drafter that
is wrong yet still accepted now and then. Here the engine's own drafter tensors are read back
(``RolloutEngine.drafter_checksums``: from vLLM's drafter model, not from our copy) and their checksums
compared, tensor by tensor, with those of the tensors the trainer pushed:

  * after a push (``verify_push``: the policy sync that precedes it, and a resume's first push, included):
    a mismatch pushes once more; one that persists is an ERROR line, counts as a failure, and the engine
    rolls out without speculation (``RolloutEngine.suspend_speculation``: depth 0 every step) until a push
    verifies, so a broken drafter never drafts;
  * after a wake (``verify_still_held``): the engine must still hold what the last verified push left;
    a mismatch is a WARNING and counts (the sync's push that follows replaces the drafter).

The acceptance floor stays as it was (the rollout's and the greedy probe's alarm): a drafter that arrived
intact can still be a poor one. Rank 0's ``spec/drafter_integrity_*`` summary fields are per step.

A checksum is four float64 figures of a tensor (its sum, the sum of its magnitudes, and its row and column
sums weighted by their index, so that swapped rows or columns show). On one device both sides reduce the same
values in the same order, so they agree exactly; ``REL_TOL`` only absorbs a GPU's other reduction order.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Protocol

import torch

logger = logging.getLogger(__name__)

TensorChecksum = tuple[float, float, float, float]
"""(sum, sum of magnitudes, row sums . row index, column sums . column index), all in float64."""

REL_TOL = 1e-9
"""Relative tolerance of a comparison, against the tensor's sum of magnitudes (x its largest index for the
index-weighted figures): float64 sums of the same float32 values in another order differ by ~1e-16 x n."""


@dataclasses.dataclass(frozen=True)
class HeldTensor:
    """One drafter tensor as the engine holds it."""

    dtype: torch.dtype
    checksum: TensorChecksum
    shape: tuple[int, ...]


def tensor_checksum(tensor: torch.Tensor) -> TensorChecksum:
    """The tensor's four float64 figures (accumulated in float64 wherever it lies, without a float64 copy)."""
    t = tensor.detach()
    matrix = t.reshape(t.shape[0], -1) if t.dim() > 1 else t.reshape(1, -1)
    matrix = matrix.contiguous()  # the same memory order on both sides: the same summation order
    rows = matrix.sum(dim=1, dtype=torch.float64)
    cols = matrix.sum(dim=0, dtype=torch.float64)
    magnitude = matrix.abs().sum(dtype=torch.float64)
    row_index = torch.arange(rows.numel(), dtype=torch.float64, device=rows.device)
    col_index = torch.arange(cols.numel(), dtype=torch.float64, device=cols.device)
    figures = torch.stack([rows.sum(), magnitude, rows @ row_index, cols @ col_index]).tolist()  # one transfer
    return tuple(figures)


def expected_checksums(tensors: Mapping[str, torch.Tensor],
                       held: Mapping[str, HeldTensor | None]) -> dict[str, TensorChecksum]:
    """Checksums of the trainer's tensors, each cast first to the dtype the engine stores it in (where the
    engine holds it; else as it is)."""
    expected = {}
    for name, tensor in tensors.items():
        found = held.get(name)
        if found is not None and found.dtype != tensor.dtype:
            tensor = tensor.to(found.dtype)
        expected[name] = tensor_checksum(tensor)
    return expected


FIGURES = ("sum", "sum of magnitudes", "row-weighted sum", "column-weighted sum")


def _first_difference(want: TensorChecksum, got: TensorChecksum, largest_index: int) -> int | None:
    """The index of the first figure that differs beyond the tolerance, or None."""
    scale = max(abs(want[1]), abs(got[1]), 1e-30)
    tolerances = (scale, scale, scale * largest_index, scale * largest_index)
    for i, (w, g, tol) in enumerate(zip(want, got, tolerances)):
        if abs(w - g) > REL_TOL * tol:
            return i
    return None


def checksum_mismatches(expected: Mapping[str, TensorChecksum], held: Mapping[str, HeldTensor | None],
                        shapes: Mapping[str, tuple[int, ...]] | None = None) -> list[str]:
    """What differs between the trainer's drafter and the engine's, one phrase per tensor (empty: it holds
    it). Tensors the engine holds beyond the trainer's (the target's shared embedding) are not compared, nor
    those it holds only a shard of on this rank (None)."""
    problems = []
    for name, want in expected.items():
        if name not in held:
            problems.append(f"{name} missing from the engine's drafter")
            continue
        got = held[name]
        if got is None:
            continue
        if shapes is not None and name in shapes and tuple(shapes[name]) != got.shape:
            problems.append(f"{name} shape {got.shape} in the engine, {tuple(shapes[name])} pushed")
            continue
        differs = _first_difference(want, got.checksum, max(got.shape or (1,)))
        if differs is not None:
            problems.append(f"{name} {FIGURES[differs]} {got.checksum[differs]:.9g} in the engine, "
                            f"{want[differs]:.9g} pushed")
    return problems


class DrafterHolder(Protocol):
    """What the check needs of an engine (``RolloutEngine``)."""

    rank: int
    speculation_suspended: bool

    def drafter_checksums(self) -> dict[str, HeldTensor]: ...

    def load_drafter(self, tensors: dict[str, torch.Tensor]) -> None: ...

    def suspend_speculation(self) -> None: ...

    def resume_speculation(self) -> None: ...

    def any_engine_rank(self, flag: bool) -> bool: ...


@dataclasses.dataclass
class IntegrityReport:
    """The checks of one engine since its last report (``spec/drafter_integrity_*`` in the step's record)."""

    checks: int = 0
    mismatches: int = 0
    """Checks that found the engine's drafter other than the trainer's (those the re-push fixed included)."""
    failures: int = 0
    """Pushes still wrong after the re-push: the engine then rolled out without speculation."""
    seconds: float = 0.0
    """Time the checks took, re-pushes included (their cost on the critical path)."""
    speculation_suspended: bool = False
    """Whether the engine is left without speculation (until a push verifies)."""


class DrafterIntegrity:
    """The hand-over checks of one engine; whether its speculation is suspended is the engine's own state."""

    def __init__(self, engine: DrafterHolder):
        self.engine = engine
        self._verified: dict[str, TensorChecksum] | None = None  # what the last verified push left
        self._report = IntegrityReport()

    def _mismatches(self, expected: Mapping[str, TensorChecksum], held: Mapping[str, HeldTensor],
                    shapes: Mapping[str, tuple[int, ...]] | None = None) -> list[str]:
        problems = checksum_mismatches(expected, held, shapes)
        # every rank of a tensor-parallel engine must take the same branch (vLLM's steps are collective)
        if self.engine.any_engine_rank(bool(problems)) and not problems:
            problems = ["another rank of this engine holds a different drafter"]
        return problems

    def _compare(self, tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, TensorChecksum], list[str]]:
        held = self.engine.drafter_checksums()
        expected = expected_checksums(tensors, held)
        shapes = {name: tuple(t.shape) for name, t in tensors.items()}
        return expected, self._mismatches(expected, held, shapes)

    def verify_push(self, tensors: Mapping[str, torch.Tensor], *, event: str) -> bool:
        """After ``tensors`` were pushed into the engine: whether it holds them, pushing once more if not;
        suspends or resumes the engine's speculation accordingly."""
        started = time.perf_counter()
        try:
            expected, problems = self._compare(tensors)
            self._report.checks += 1
            if problems:
                self._report.mismatches += 1
                logger.warning("rank %d: the engine's drafter is not the one pushed %s (%s); pushing it again",
                               self.engine.rank, event, "; ".join(problems[:3]))
                self.engine.load_drafter(dict(tensors))
                expected, problems = self._compare(tensors)
            if problems:
                self._report.failures += 1
                self._verified = None
                logger.error("rank %d: the engine's drafter is still not the one pushed %s after a second push (%s): "
                             "rollouts go on without speculation until a push verifies",
                             self.engine.rank, event, "; ".join(problems[:3]))
                self.engine.suspend_speculation()  # a no-op where it already is
                return False
            self._verified = expected
            if self.speculation_suspended:
                self.engine.resume_speculation()
                logger.info("rank %d: the drafter pushed %s verified: speculation is back on", self.engine.rank, event)
            return True
        finally:
            self._report.seconds += time.perf_counter() - started

    def verify_still_held(self, *, event: str) -> bool:
        """Whether the engine still holds the drafter of the last verified push (after a wake); a mismatch is a
        WARNING and counts: the next push replaces it and is verified in turn. True where nothing was verified yet."""
        if self._verified is None:
            return True
        started = time.perf_counter()
        try:
            problems = self._mismatches(self._verified, self.engine.drafter_checksums())
            self._report.checks += 1
            if problems:
                self._report.mismatches += 1
                logger.warning("rank %d: the engine's drafter changed %s (%s); the next push replaces it",
                               self.engine.rank, event, "; ".join(problems[:3]))
            return not problems
        finally:
            self._report.seconds += time.perf_counter() - started

    @property
    def speculation_suspended(self) -> bool:
        return self.engine.speculation_suspended

    def drain_report(self) -> IntegrityReport:
        """The checks since the last call (a step's), and whether speculation is suspended now."""
        report, self._report = self._report, IntegrityReport()
        report.speculation_suspended = self.speculation_suspended
        return report
