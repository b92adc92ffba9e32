"""The drafter micro-step's preemption points: a rank the rollout needs again is released within a draft step.

Deterministic: ``should_stop`` answers by call count, no timing is asserted.
"""

import pytest
import torch

from megatron_tlt.config import DrafterConfig
from megatron_tlt.drafter.trainer import DrafterTrainer
from megatron_tlt.formats.architecture import architecture_from_dict
from tiny_models import TINY_LLAMA

LLAMA = architecture_from_dict(TINY_LLAMA)
UNROLL_STEPS = 3
# after each draft step's forward, after the forward, as the backward reaches each step, after the backward
POINTS = UNROLL_STEPS + 1 + UNROLL_STEPS + 1
LENGTHS = (20, 9, 14)  # tokens: a sequence of n gives n - 2 training rows, all in one pack


def _trainer() -> DrafterTrainer:
    g = torch.Generator().manual_seed(3)
    settings = DrafterConfig(lr=1e-3, buffer_tokens=256, pack_tokens=128, unroll_steps=UNROLL_STEPS)
    trainer = DrafterTrainer(LLAMA, settings, seed=0)
    trainer.set_policy_heads({"model.embed_tokens.weight": torch.randn(LLAMA.vocab_size, LLAMA.hidden_size,
                                                                         generator=g)})
    token_ids = [torch.randint(0, LLAMA.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
    features = [torch.randn(n - 1, LLAMA.hidden_size, generator=g) for n in LENGTHS]
    trainer.add_sequences(token_ids, features)
    return trainer


def _parameters(trainer: DrafterTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.drafter.parameters()]


def test_a_micro_step_asks_after_every_draft_step_of_the_forward_and_inside_the_backward():
    trainer = _trainer()
    asked_with_grad_mode = []

    def should_stop() -> bool:
        asked_with_grad_mode.append(torch.is_grad_enabled())  # off inside the backward pass
        return False

    assert trainer.micro_step(should_stop) == sum(n - 2 for n in LENGTHS)
    forward, backward = [True] * (UNROLL_STEPS + 1), [False] * UNROLL_STEPS
    assert asked_with_grad_mode == forward + backward + [True]


@pytest.mark.parametrize("stop_at", range(POINTS))
def test_a_step_preempted_at_any_point_makes_no_update_and_its_pack_is_trained_next(stop_at):
    reference = _trainer()
    assert reference.micro_step() > 0
    trainer = _trainer()
    before = _parameters(trainer)
    calls = []

    def should_stop() -> bool:
        calls.append(None)
        return len(calls) > stop_at

    assert trainer.micro_step(should_stop) == 0
    assert len(calls) == stop_at + 1  # abandoned at the first yes
    assert trainer.dropped_steps == 1 and trainer.tokens_trained == 0
    assert all(p.grad is None for p in trainer.drafter.parameters())
    for old, new in zip(before, trainer.drafter.parameters()):
        torch.testing.assert_close(new, old, rtol=0, atol=0)
    # the dropped pack comes first: the next step is the reference's uninterrupted one
    assert trainer.micro_step() == reference.tokens_trained
    for expected, got in zip(reference.drafter.parameters(), trainer.drafter.parameters()):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
