"""The drafter integrity check's pure parts: checksums, their comparison, and the re-push / suspend / resume
state machine, against a plain in-memory holder of a drafter (the real engine's side, read back from vLLM, is
tested in tests/dist/test_drafter_integrity.py)."""

import logging

import pytest
import torch

from megatron_tlt.spec.drafter_integrity import (DrafterIntegrity, HeldTensor, checksum_mismatches,
                                                 expected_checksums, tensor_checksum)


def _drafter(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"fc.weight": torch.randn(8, 16, generator=g), "layers.0.mlp.gate_proj.weight": torch.randn(12, 8, generator=g),
            "layers.0.mlp.up_proj.weight": torch.randn(12, 8, generator=g),
            "layers.0.post_attention_layernorm.weight": torch.ones(8)}


def _held(tensors: dict[str, torch.Tensor]) -> dict[str, HeldTensor]:
    return {name: HeldTensor(t.dtype, tensor_checksum(t), tuple(t.shape)) for name, t in tensors.items()}


def test_the_same_tensors_match_exactly_and_every_kind_of_wrong_tensor_is_named():
    pushed = _drafter()
    expected = expected_checksums(pushed, _held(pushed))
    assert checksum_mismatches(expected, _held(pushed)) == []
    assert all(expected[name] == _held(pushed)[name].checksum for name in pushed)  # bit-equal figures on one device
    gate, up = "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight"
    swapped = dict(pushed, **{gate: pushed[up], up: pushed[gate]})
    assert sorted(p.split()[0] for p in checksum_mismatches(expected, _held(swapped))) == [gate, up]
    fc = pushed["fc.weight"]
    for wrong in (torch.zeros_like(fc), fc.flip(0), fc.roll(8, dims=1), fc + 1e-4 * torch.ones_like(fc)):
        problems = checksum_mismatches(expected, _held(dict(pushed, **{"fc.weight": wrong})))
        assert len(problems) == 1 and problems[0].startswith("fc.weight"), problems
    missing = {k: v for k, v in _held(pushed).items() if k != "fc.weight"}
    assert checksum_mismatches(expected, missing) == ["fc.weight missing from the engine's drafter"]
    # a tensor this rank holds only a shard of is not compared; one the engine has beyond the push is ignored
    extra = dict(_held(pushed), **{gate: None, "lm_head.weight": HeldTensor(torch.float32, (1.0,) * 4, (2, 2))})
    assert checksum_mismatches(expected, extra) == []


def test_a_bfloat16_engine_is_compared_with_the_pushed_tensors_cast_to_bfloat16():
    pushed = _drafter()
    held = _held({name: t.to(torch.bfloat16) for name, t in pushed.items()})
    assert checksum_mismatches(expected_checksums(pushed, held), held) == []
    assert checksum_mismatches({n: tensor_checksum(t) for n, t in pushed.items()}, held)  # uncast: differs


def test_a_reduction_in_another_order_is_within_the_tolerance():
    t = torch.randn(64, 64, dtype=torch.float32)
    want = tensor_checksum(t)
    reordered = tuple(v * (1 + 1e-14) for v in want)  # what a GPU's float64 reduction order may change
    assert checksum_mismatches({"w": want}, {"w": HeldTensor(t.dtype, reordered, (64, 64))}) == []


class InMemoryEngine:
    """Holds a drafter as an engine would; ``faulty_pushes`` pushes land with gate and up swapped."""

    rank = 0

    def __init__(self, tensors):
        self.held = dict(tensors)
        self.faulty_pushes = 0
        self.pushes = 0
        self.suspended = False

    def drafter_checksums(self):
        return _held(self.held)

    def load_drafter(self, tensors):
        self.pushes += 1
        self.held = dict(tensors)
        if self.faulty_pushes:
            self.faulty_pushes -= 1
            gate, up = "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight"
            self.held[gate], self.held[up] = tensors[up], tensors[gate]

    @property
    def speculation_suspended(self):
        return self.suspended

    def suspend_speculation(self):
        self.suspended = True

    def resume_speculation(self):
        self.suspended = False

    def any_engine_rank(self, flag):
        return flag


def _pushed(engine, integrity, tensors):
    engine.load_drafter(tensors)
    return integrity.verify_push(tensors, event="in the test")


def test_a_wrong_push_is_pushed_again_once_and_the_second_push_repairs_it(caplog):
    tensors = _drafter()
    engine = InMemoryEngine(tensors)
    integrity = DrafterIntegrity(engine)
    engine.faulty_pushes = 1
    with caplog.at_level(logging.WARNING):
        assert _pushed(engine, integrity, tensors)
    assert engine.pushes == 2 and not engine.suspended
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    report = integrity.drain_report()
    assert (report.checks, report.mismatches, report.failures, report.speculation_suspended) == (1, 1, 0, False)


def test_a_fault_that_persists_is_an_error_suspends_speculation_until_a_push_verifies(caplog):
    tensors = _drafter()
    engine = InMemoryEngine(tensors)
    integrity = DrafterIntegrity(engine)
    engine.faulty_pushes = 2
    with caplog.at_level(logging.WARNING):
        assert not _pushed(engine, integrity, tensors)
    assert engine.pushes == 2 and engine.suspended and integrity.speculation_suspended
    assert [r.levelname for r in caplog.records] == ["WARNING", "ERROR"]
    assert "without speculation" in caplog.records[-1].message
    report = integrity.drain_report()
    assert (report.mismatches, report.failures, report.speculation_suspended) == (1, 1, True)
    assert integrity.drain_report().speculation_suspended  # still suspended in the next step's report
    engine.faulty_pushes = 2  # the next step's push is wrong again: counted again, still suspended, no re-suspend
    assert not _pushed(engine, integrity, tensors)
    assert integrity.drain_report().failures == 1 and engine.suspended
    assert _pushed(engine, integrity, _drafter(seed=1))  # a good push: speculation is back
    assert not engine.suspended and not integrity.drain_report().speculation_suspended


def test_a_drafter_changed_after_a_wake_is_detected_against_the_last_verified_push():
    tensors = _drafter()
    engine = InMemoryEngine(tensors)
    integrity = DrafterIntegrity(engine)
    assert integrity.verify_still_held(event="before any push")  # nothing verified yet: nothing to hold
    assert _pushed(engine, integrity, tensors)
    assert integrity.verify_still_held(event="after a wake")
    engine.held = {name: torch.zeros_like(t) for name, t in tensors.items()}  # the wake lost it
    assert not integrity.verify_still_held(event="after a wake")
    assert integrity.drain_report().mismatches == 1
    assert _pushed(engine, integrity, tensors) and integrity.verify_still_held(event="after the push")


def test_a_mismatch_on_another_rank_of_the_engine_takes_this_rank_down_the_same_branch():
    tensors = _drafter()
    engine = InMemoryEngine(tensors)
    engine.any_engine_rank = lambda flag: True  # the other rank's vote
    integrity = DrafterIntegrity(engine)
    assert not _pushed(engine, integrity, tensors)
    assert engine.pushes == 2 and engine.suspended  # re-pushed and suspended with it


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4)])
def test_checksums_of_any_rank_are_four_finite_figures(shape):
    figures = tensor_checksum(torch.randn(shape))
    assert len(figures) == 4 and all(isinstance(f, float) for f in figures)
