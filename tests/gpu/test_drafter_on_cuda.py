"""The EAGLE drafter's trainer on the GPU: in bf16, and in FP8 through Transformer Engine where both are
there, a few micro-steps on one fixed pack lower its loss, with and without unrolling over draft steps."""

import pytest
import torch

from megatron_tlt.model_config import architecture_from_dict
from megatron_tlt.tiny_models import TINY_LLAMA, next_token_fixture

pytestmark = pytest.mark.needs("cuda")

LLAMA = architecture_from_dict(TINY_LLAMA)
# 21 + 38 + 59 = 118 training rows in one pack: the spot trainer's packs have any number of rows,
# not a multiple of 8 or 16.
LENGTHS = (23, 40, 61)
MICRO_STEPS = 20


def _next_token_target_sequences():
    """Sequences of the next-token target (tiny_models.next_token_fixture), whose feature f_t is
    rmsnorm(embed(x_t)), as the log-prob pass would capture them (rows 0 .. L-2); and its HF heads."""
    target = next_token_fixture(LLAMA)["target"]
    embed = target["model.embed_tokens.weight"]
    generator = torch.Generator().manual_seed(0)
    token_ids, features = [], []
    for length in LENGTHS:
        tokens = torch.randint(0, LLAMA.vocab_size, (length,), generator=generator)
        e = embed[tokens[:-1]]
        token_ids.append(tokens.tolist())
        features.append(e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + LLAMA.rms_norm_eps))
    return target, token_ids, features


def _trainer_with_one_pack(precision: str, unroll_steps: int):
    """A drafter trainer at ``precision`` whose buffer holds the target's sequences as one pack; returns it with
    the sequences' token ids and features (on the trainer's device and dtype, as the log-prob pass leaves them)."""
    from megatron_tlt.config import DrafterConfig
    from megatron_tlt.drafter.precision import resolve_precision
    from megatron_tlt.drafter.trainer import DrafterTrainer

    settings = DrafterConfig(lr=3e-3, buffer_tokens=4096, pack_tokens=1024, hidden_weight=1.0, ce_weight=0.1,
                             unroll_steps=unroll_steps)
    trainer = DrafterTrainer(LLAMA, settings, seed=0, precision=resolve_precision(precision))
    heads, token_ids, features = _next_token_target_sequences()
    trainer.set_policy_heads(heads)
    p = trainer.precision
    features = [f.to(p.device, p.dtype) for f in features]
    trainer.add_sequences(token_ids, features)
    return trainer, token_ids, features


@pytest.mark.parametrize("unroll_steps", [1, 4])
@pytest.mark.parametrize("precision", ["bf16", pytest.param("fp8", marks=pytest.mark.needs("fp8"))])
def test_drafter_micro_steps_on_cuda_lower_the_loss_on_a_fixed_pack(precision, unroll_steps):
    trainer, token_ids, features = _trainer_with_one_pack(precision, unroll_steps)
    p = trainer.precision
    assert trainer.packs_in_buffer() == 1
    before = trainer.evaluate(token_ids, features)
    trained = [trainer.micro_step() for _ in range(MICRO_STEPS)]
    after = trainer.evaluate(token_ids, features)
    assert (p.name, p.device.type) == (precision, "cuda")
    assert trained == [sum(LENGTHS) - 2 * len(LENGTHS)] * MICRO_STEPS  # every step trained the whole pack
    assert after["loss_sum"] < 0.8 * before["loss_sum"], (before, after)


@pytest.mark.parametrize("precision", ["bf16", pytest.param("fp8", marks=pytest.mark.needs("fp8"))])
def test_a_micro_step_preempted_inside_the_backward_on_cuda_is_dropped_without_an_update(precision):
    """The backward's preemption points are gradient hooks; on CUDA the autograd engine runs them on its
    device thread, and the hook's exception must still reach the trainer and drop the step."""
    trainer, _, _ = _trainer_with_one_pack(precision, unroll_steps=4)
    before = [t.detach().clone() for t in trainer.drafter.parameters()]
    grad_modes = []

    def stop_inside_the_backward() -> bool:
        grad_modes.append(torch.is_grad_enabled())
        return not grad_modes[-1]  # grad mode is off only inside the backward pass

    assert trainer.micro_step(stop_inside_the_backward) == 0
    assert grad_modes == [True] * 5 + [False] and trainer.dropped_steps == 1
    assert all(t.grad is None for t in trainer.drafter.parameters())
    for old, new in zip(before, trainer.drafter.parameters()):
        torch.testing.assert_close(new, old, rtol=0, atol=0)
    assert trainer.micro_step() == sum(LENGTHS) - 2 * len(LENGTHS)  # the same pack, now trained
