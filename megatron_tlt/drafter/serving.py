"""The drafter the engines serve, measured every step, and the gate a trained candidate passes to replace it.

Online training changes the drafter on the ranks; what the engines draft with changes only at a push. This
module keeps the two apart: ``ServingDrafter`` holds a copy of the drafter last pushed (what every engine
holds) and the reference, the drafter the run started from (the cold start, kept frozen). Each step, on a
held-out slice of that step's fresh rollouts (never trained on: the trainer keeps it out of the buffer), it
measures all of them with the same teacher-forced acceptance (``drafter/quality.py``), and, where the spot
trainer produced a candidate since the last push, pushes it only if its expected acceptance length there is
at least the serving drafter's. Otherwise the serving drafter stays and training goes on from the candidate:
the rollout is never given a drafter that measured worse than the one it has (within the measure's noise).

Every figure is summed over ranks (one all-reduce), so every rank takes the same decision.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_tlt.drafter.model import EagleDrafter
from megatron_tlt.drafter.quality import AcceptanceTally, measure


@dataclasses.dataclass
class QualityReport:
    """One step's held-out measure of the drafters, and the push decision taken from it."""

    depth: int
    serving: AcceptanceTally
    """The drafter the step's rollout drafted with."""
    cold_start: AcceptanceTally
    """The drafter the run started from, never trained."""
    candidate: AcceptanceTally | None
    """The drafter trained since the last push (None: none trained)."""
    pushed: bool | None
    """Whether the candidate replaced the serving drafter (None: no candidate this step)."""
    pushes: int
    """Candidates pushed over the run so far."""
    declined: int
    """Candidates declined over the run so far."""
    seconds: float
    """This rank's time measuring (the held-out forward of the policy not included)."""


@dataclasses.dataclass(frozen=True)
class MeasureSettings:
    depth: int
    """The draft depth the expected acceptance length is taken at (the engines' deepest)."""
    temperature: float
    greedy_draft: bool
    pack_tokens: int
    gate: bool
    """Push a candidate only when it measures at least as well as the serving drafter (else: always)."""

    @classmethod
    def from_config(cls, config, *, depth: int) -> "MeasureSettings":
        """The measure a run's config asks for at ``depth``: its rollout temperature, draft sampling and packing."""
        return cls(depth=depth, temperature=config.rollout.temperature,
                   greedy_draft=config.speculation.draft_sampling == "greedy",
                   pack_tokens=config.drafter.pack_tokens, gate=config.drafter.push_gate)

    def measure_kwargs(self) -> dict:
        """``quality.measure``'s settings."""
        return dict(depth=self.depth, temperature=self.temperature, greedy_draft=self.greedy_draft,
                    pack_tokens=self.pack_tokens)


def candidate_wins(candidate: AcceptanceTally, serving: AcceptanceTally) -> bool:
    """The gate: at least the serving drafter's expected acceptance length on the same held-out chains. With no
    chain to judge by (an empty slice) the serving drafter stays."""
    return candidate.chains > 0 and candidate.expected_length >= serving.expected_length


class ServingDrafter:
    """What the engines hold, the run's starting drafter beside it, and the push gate (module docstring)."""

    def __init__(self, start: EagleDrafter, settings: MeasureSettings, *, pushes: int = 0, declined: int = 0):
        """``start``: the drafter the engines are given first (copied, as is the reference: the same weights)."""
        self.settings = settings
        self.drafter = copy.deepcopy(start).requires_grad_(False).eval()
        self.reference = copy.deepcopy(start).requires_grad_(False).eval()
        self.pushes, self.declined = pushes, declined
        self._serving_is_reference = True  # until a push: one measure serves both

    def set_reference(self, tensors: dict[str, Tensor]) -> None:
        """The cold start to compare with, where the run did not start from it (a resumed run)."""
        self.reference.load_tensors(tensors)
        self._serving_is_reference = False

    def export_tensors(self) -> dict[str, Tensor]:
        return self.drafter.export_tensors()

    @torch.no_grad()
    def _copy_from(self, candidate: EagleDrafter) -> None:
        for served, trained in zip(self.drafter.parameters(), candidate.parameters()):
            served.copy_(trained)

    def measure_and_gate(self, candidate: EagleDrafter | None,
                         held_out: Sequence[tuple[Sequence[int], Tensor, int]], *, embedding_vh: Tensor,
                         lm_head_vh: Tensor, group=None) -> QualityReport:
        """Measure the serving drafter, the reference and ``candidate`` (None: nothing trained since the last
        push) on this rank's ``held_out`` ``(token_ids, features, prompt_len)`` sequences, sum over the ranks of
        ``group`` (collective where torch.distributed is up: every rank calls it, with or without held-out
        sequences), and push the candidate if the gate lets it through."""
        started = time.perf_counter()
        s = self.settings
        kwargs = dict(embedding_vh=embedding_vh, lm_head_vh=lm_head_vh, **s.measure_kwargs())
        drafters = [self.drafter] + ([] if self._serving_is_reference else [self.reference])
        drafters += [candidate] if candidate is not None else []
        tallies = [measure(d, held_out, **kwargs) if held_out else AcceptanceTally.empty(s.depth) for d in drafters]
        if dist.is_available() and dist.is_initialized():
            stacked = torch.stack([t.as_tensor() for t in tallies]).to(embedding_vh.device)  # NCCL: on the GPU
            dist.all_reduce(stacked, group=group)
            tallies = [AcceptanceTally.from_tensor(s.depth, row.cpu()) for row in stacked]
        if self._serving_is_reference:
            tallies.insert(1, tallies[0])
        pushed = None
        if candidate is not None:
            pushed = candidate_wins(tallies[2], tallies[0]) if s.gate else True
            if pushed:
                self._copy_from(candidate)
                self.pushes += 1
                self._serving_is_reference = False
            else:
                self.declined += 1
        return QualityReport(depth=s.depth, serving=tallies[0], cold_start=tallies[1],
                             candidate=tallies[2] if candidate is not None else None, pushed=pushed,
                             pushes=self.pushes, declined=self.declined, seconds=time.perf_counter() - started)


def quality_fields(report: QualityReport | None) -> dict:
    """The step's ``drafter/quality/*`` and push fields of ``summary.json`` (none where nothing was measured)."""
    if report is None:
        return {}
    fields = {
        "drafter/quality/depth": report.depth,
        "drafter/quality/chains": report.serving.chains,
        "drafter/quality/expected_acceptance_length": report.serving.expected_length,
        # by draft position, "1".."K" (a dict: a list of numbers would be read as one per rank)
        "drafter/quality/acceptance_by_position": _by_position(report.serving),
        "drafter/quality/cold_start_expected_acceptance_length": report.cold_start.expected_length,
        "drafter/quality/cold_start_acceptance_by_position": _by_position(report.cold_start),
        "drafter/quality/policy_entropy": report.serving.mean_entropy,
        "drafter/quality/seconds": report.seconds,
        "drafter/pushes": report.pushes,
        "drafter/pushes_declined": report.declined,
    }
    if report.candidate is not None:
        fields["drafter/quality/candidate_expected_acceptance_length"] = report.candidate.expected_length
        fields["drafter/pushed"] = report.pushed
    return fields


def _by_position(tally: AcceptanceTally) -> dict[str, float]:
    return {str(k): a for k, a in enumerate(tally.acceptance_by_position, start=1)}
