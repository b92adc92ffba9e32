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


@pytest.mark.parametrize("unroll_steps", [1, 4])
@pytest.mark.parametrize("precision", ["bf16", pytest.param("fp8", marks=pytest.mark.needs("fp8"))])
def test_drafter_micro_steps_on_cuda_lower_the_loss_on_a_fixed_pack(precision, unroll_steps):
    from megatron_tlt.drafter.precision import resolve_precision
    from megatron_tlt.config import DrafterConfig
    from megatron_tlt.drafter.trainer import DrafterTrainer

    settings = DrafterConfig(lr=3e-3, buffer_tokens=4096, pack_tokens=1024, hidden_weight=1.0, ce_weight=0.1,
                             unroll_steps=unroll_steps)
    trainer = DrafterTrainer(LLAMA, settings, seed=0, precision=resolve_precision(precision))
    heads, token_ids, features = _next_token_target_sequences()
    trainer.set_policy_heads(heads)
    p = trainer.precision
    features = [f.to(p.device, p.dtype) for f in features]  # where and as the log-prob pass leaves them
    trainer.add_sequences(token_ids, features)
    assert trainer.packs_in_buffer() == 1
    before = trainer.evaluate(token_ids, features)
    trained = [trainer.micro_step() for _ in range(MICRO_STEPS)]
    after = trainer.evaluate(token_ids, features)
    assert (p.name, p.device.type) == (precision, "cuda")
    assert trained == [sum(LENGTHS) - 2 * len(LENGTHS)] * MICRO_STEPS  # every step trained the whole pack
    assert after["loss_sum"] < 0.8 * before["loss_sum"], (before, after)
