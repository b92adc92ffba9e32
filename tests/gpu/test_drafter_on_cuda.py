"""The EAGLE drafter's trainer on the GPU: in bf16, and in FP8 through each backend there is (Transformer Engine,
torchao) on a GPU with FP8 tensor cores, a few micro-steps on one fixed pack lower its loss, with and without
unrolling over draft steps, and what it exports stays vLLM's tensors in bf16."""

import pytest
import torch

from megatron_tlt.formats.architecture import architecture_from_dict
from tiny_models import TINY_LLAMA, next_token_fixture

pytestmark = pytest.mark.needs("cuda")

LLAMA = architecture_from_dict(TINY_LLAMA)
# 21 + 38 + 59 = 118 training rows in one pack: the spot trainer's packs have any number of rows,
# not a multiple of 8 or 16.
LENGTHS = (23, 40, 61)
MICRO_STEPS = 20
# The precisions a drafter trains in on a GPU: bf16, and FP8 through each backend (drafter/precision.py).
ARMS = ["bf16", pytest.param("transformer_engine", marks=pytest.mark.needs("fp8_transformer_engine")),
        pytest.param("torchao", marks=pytest.mark.needs("fp8_torchao"))]


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


def _precision(arm: str):
    """bf16 as drafter.precision=bf16 resolves it; FP8 through the backend ``arm`` names."""
    from megatron_tlt.device import compute_device
    from megatron_tlt.drafter.precision import DrafterPrecision, resolve_precision

    if arm == "bf16":
        return resolve_precision("bf16")
    return DrafterPrecision(compute_device(), torch.bfloat16, fp8_backend=arm)


def _trainer_with_one_pack(arm: str, unroll_steps: int):
    """A drafter trainer in ``arm`` (``ARMS``) whose buffer holds the target's sequences as one pack; returns it with
    the sequences' token ids and features (on the trainer's device and dtype, as the log-prob pass leaves them)."""
    from megatron_tlt.config import DrafterConfig
    from megatron_tlt.drafter.trainer import DrafterTrainer

    settings = DrafterConfig(lr=3e-3, buffer_tokens=4096, pack_tokens=1024, hidden_weight=1.0, ce_weight=0.1,
                             unroll_steps=unroll_steps)
    trainer = DrafterTrainer(LLAMA, settings, seed=0, precision=_precision(arm))
    heads, token_ids, features = _next_token_target_sequences()
    trainer.set_policy_heads(heads)
    p = trainer.precision
    features = [f.to(p.device, p.dtype) for f in features]
    trainer.add_sequences(token_ids, features)
    return trainer, token_ids, features


@pytest.mark.parametrize("unroll_steps", [1, 4])
@pytest.mark.parametrize("arm", ARMS)
def test_drafter_micro_steps_on_cuda_lower_the_loss_on_a_fixed_pack(arm, unroll_steps):
    from megatron_tlt.spec.eagle import expected_drafter_shapes

    trainer, token_ids, features = _trainer_with_one_pack(arm, unroll_steps)
    p = trainer.precision
    assert trainer.packs_in_buffer() == 1
    before = trainer.evaluate(token_ids, features)
    trained = [trainer.micro_step() for _ in range(MICRO_STEPS)]
    after = trainer.evaluate(token_ids, features)
    assert (p.label, p.device.type) == ("bf16" if arm == "bf16" else f"fp8 ({arm})", "cuda")
    assert trained == [sum(LENGTHS) - 2 * len(LENGTHS)] * MICRO_STEPS  # every step trained the whole pack
    assert after["loss_sum"] < 0.8 * before["loss_sum"], (before, after)
    exported = trainer.export_tensors()  # vLLM's names only: no TE _extra_state, no torchao state
    assert set(exported) == set(expected_drafter_shapes(LLAMA))
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in exported.values())


@pytest.mark.needs("fp8")
def test_fp8_on_this_gpu_takes_transformer_engine_where_it_imports_else_torchao_and_auto_only_what_measured_faster():
    from megatron_tlt.drafter.fp8_measured import FP8_PAYS_AT, load_rows
    from megatron_tlt.drafter.precision import TORCHAO, TRANSFORMER_ENGINE, backend_import_error, resolve_precision

    expected = TRANSFORMER_ENGINE if backend_import_error(TRANSFORMER_ENGINE) is None else TORCHAO
    fp8 = resolve_precision("fp8")
    assert (fp8.label, fp8.dtype) == (f"fp8 ({expected})", torch.bfloat16)
    auto = resolve_precision("auto")
    name = torch.cuda.get_device_name()
    paying = {row.backend for row in load_rows() if row.device == name and row.compile == "eager"
              and row.vs_bf16 >= FP8_PAYS_AT and backend_import_error(row.backend) is None}
    assert auto.fp8 == bool(paying) and (auto.fp8_backend in paying or not auto.fp8), (auto, paying)
    assert auto.reason.startswith("auto: ") and name in auto.reason
    assert fp8.describe().startswith("drafter trains in fp8 through " + {TRANSFORMER_ENGINE: "Transformer Engine",
                                                                         TORCHAO: "torchao float8"}[expected])


@pytest.mark.parametrize("arm", ARMS)
def test_a_micro_step_preempted_inside_the_backward_on_cuda_is_dropped_without_an_update(arm):
    """The backward's preemption points are gradient hooks; on CUDA the autograd engine runs them on its
    device thread, and the hook's exception must still reach the trainer and drop the step."""
    trainer, _, _ = _trainer_with_one_pack(arm, unroll_steps=4)
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
