import pytest
import torch

from megatron_tlt.drafter.model import EagleDrafter
from megatron_tlt.drafter.precision import fp8_unavailable_reason, resolve_precision
from megatron_tlt.model_config import architecture_from_dict
from megatron_tlt.tiny_models import TINY_LLAMA

LLAMA = architecture_from_dict(TINY_LLAMA)
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="what a CPU-only machine resolves to")


@no_cuda
def test_auto_is_fp32_on_cpu_and_fp8_is_refused_with_the_reason():
    precision = resolve_precision("auto")
    assert (precision.device.type, precision.dtype, precision.fp8, precision.name) == ("cpu", torch.float32, False, "fp32")
    assert fp8_unavailable_reason() == "no CUDA device"
    with pytest.raises(ValueError, match="fp8 cannot run here: no CUDA device"):
        resolve_precision("fp8")


def test_bf16_drafter_trains_with_the_same_tensor_names_and_an_unknown_precision_is_refused():
    precision = resolve_precision("bf16")
    drafter = EagleDrafter(LLAMA, dtype=precision.dtype, device=precision.device)
    assert all(t.dtype == torch.bfloat16 for t in drafter.export_tensors().values())
    assert set(drafter.export_tensors()) == set(EagleDrafter(LLAMA).export_tensors())
    with pytest.raises(ValueError, match="drafter.precision must be one of auto, fp32, bf16, fp8"):
        resolve_precision("fp16")


@pytest.mark.skipif(fp8_unavailable_reason() is not None, reason=f"FP8: {fp8_unavailable_reason()}")
def test_fp8_drafter_exports_only_the_vllm_tensors_and_trains():
    from megatron_tlt.drafter.precision import autocast

    precision = resolve_precision("fp8")
    drafter = EagleDrafter(LLAMA, dtype=precision.dtype, device=precision.device, fp8=True)
    assert set(drafter.export_tensors()) == set(EagleDrafter(LLAMA).export_tensors())  # no TE _extra_state
    t, h = 32, LLAMA.hidden_size
    with autocast(precision):
        out = drafter(torch.randn(t, h, device="cuda", dtype=torch.bfloat16),
                      torch.randn(t, h, device="cuda", dtype=torch.bfloat16), torch.arange(t, device="cuda"),
                      torch.zeros(t, dtype=torch.long, device="cuda"))
    out.float().pow(2).mean().backward()
    assert drafter.fc.weight.grad is not None and torch.isfinite(drafter.fc.weight.grad).all()
