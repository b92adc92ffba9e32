"""The push gate (drafter/serving.py): a trained drafter replaces the serving one only if it measures at least as
well on the held-out slice; the figures of every drafter land in summary.json's fields."""

import pytest
import torch

from megatron_tlt.drafter.model import EagleDrafter
from megatron_tlt.drafter.quality import AcceptanceTally
from megatron_tlt.drafter.serving import MeasureSettings, ServingDrafter, candidate_wins, quality_fields
from megatron_tlt.formats.architecture import architecture_from_dict
from tiny_models import TINY_LLAMA, next_token_fixture

ARCH = architecture_from_dict(TINY_LLAMA)
SETTINGS = MeasureSettings(depth=3, temperature=1.0, greedy_draft=False, pack_tokens=1024, gate=True)


@pytest.fixture(scope="module")
def fixture():
    """Held-out sequences whose features are their tokens' (unit-RMS) embeddings: the fixture's good drafter
    predicts them exactly, its bad one ignores the token."""
    fx = next_token_fixture(ARCH)
    embed = fx["target"]["model.embed_tokens.weight"]
    embed = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True))
    generator = torch.Generator().manual_seed(0)
    held_out = []
    for length, prompt_len in ((40, 8), (30, 5)):
        tokens = torch.randint(0, ARCH.vocab_size, (length,), generator=generator)
        held_out.append((tokens.tolist(), embed[tokens[:-1]], prompt_len))
    return dict(good=EagleDrafter.from_tensors(ARCH, fx["good_drafter"]),
                bad=EagleDrafter.from_tensors(ARCH, fx["bad_drafter"]), held_out=held_out,
                heads=dict(embedding_vh=embed, lm_head_vh=fx["target"]["lm_head.weight"]))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_better_candidate_is_pushed_and_a_worse_one_is_declined(fixture):
    good, bad = fixture["good"], fixture["bad"]
    serving = ServingDrafter(bad, SETTINGS)
    report = serving.measure_and_gate(good, fixture["held_out"], **fixture["heads"])
    assert report.pushed and (report.pushes, report.declined) == (1, 0)
    assert report.candidate.expected_length > report.serving.expected_length
    assert _same(serving.export_tensors(), good.export_tensors())  # the engines now get the better one
    # the drafter the run started from stays the reference, whatever was pushed since
    assert report.cold_start.expected_length == pytest.approx(report.serving.expected_length)

    worse = serving.measure_and_gate(bad, fixture["held_out"], **fixture["heads"])  # made worse on purpose
    assert worse.pushed is False and (worse.pushes, worse.declined) == (1, 1)
    assert _same(serving.export_tensors(), good.export_tensors())  # the serving drafter stays
    assert worse.serving.expected_length == pytest.approx(SETTINGS.depth + 1, abs=1e-4)
    assert worse.cold_start.expected_length < worse.serving.expected_length


def test_without_a_candidate_nothing_is_decided_and_without_the_gate_every_candidate_is_pushed(fixture):
    serving = ServingDrafter(fixture["good"], SETTINGS)
    report = serving.measure_and_gate(None, fixture["held_out"], **fixture["heads"])
    assert report.pushed is None and report.candidate is None and (report.pushes, report.declined) == (0, 0)
    ungated = ServingDrafter(fixture["good"], MeasureSettings(**{**SETTINGS.__dict__, "gate": False}))
    assert ungated.measure_and_gate(fixture["bad"], fixture["held_out"], **fixture["heads"]).pushed
    assert _same(ungated.export_tensors(), fixture["bad"].export_tensors())


def test_the_serving_drafter_is_a_copy_that_training_the_candidate_does_not_reach(fixture):
    candidate = EagleDrafter(ARCH, seed=1)
    serving = ServingDrafter(candidate, SETTINGS)
    before = serving.export_tensors()
    with torch.no_grad():
        candidate.fc.weight.add_(1.0)  # what an optimizer step does to the trainer's drafter
    assert _same(serving.export_tensors(), before)


def test_an_empty_slice_keeps_the_serving_drafter():
    empty = AcceptanceTally.empty(3)
    assert not candidate_wins(empty, empty)


def test_quality_fields_name_every_drafter_and_the_decision(fixture):
    serving = ServingDrafter(fixture["bad"], SETTINGS)
    report = serving.measure_and_gate(fixture["good"], fixture["held_out"], **fixture["heads"])
    fields = quality_fields(report)
    assert fields["drafter/quality/depth"] == 3 and fields["drafter/pushed"] is True
    assert fields["drafter/quality/candidate_expected_acceptance_length"] == pytest.approx(4.0, abs=1e-4)
    assert set(fields["drafter/quality/acceptance_by_position"]) == {"1", "2", "3"}
    assert fields["drafter/quality/policy_entropy"] > 0
    assert (fields["drafter/pushes"], fields["drafter/pushes_declined"]) == (1, 0)
    assert quality_fields(None) == {}
