"""Where and in what precision the drafter trains: fp32 on CPU; bf16 on GPU, or FP8 through Transformer Engine.

``drafter.precision``:
  * ``auto``: fp8 where Transformer Engine is installed and the GPU has FP8 tensor cores (compute
    capability 8.9+: Ada, Hopper), else bf16 on GPU, fp32 on CPU;
  * ``fp32`` / ``bf16``: plain torch;
  * ``fp8``: asked for explicitly, refused with the reason where it cannot run.
With FP8 the drafter's linear layers are ``transformer_engine.pytorch.Linear`` (bf16 master weights, FP8
GEMMs with delayed scaling inside ``fp8_autocast``); the weights the engines get stay bf16.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from megatron_tlt.config import DRAFTER_PRECISIONS
from megatron_tlt.device import compute_device

_FP8_MIN_CAPABILITY = (8, 9)


@dataclasses.dataclass(frozen=True)
class DrafterPrecision:
    device: torch.device
    dtype: torch.dtype
    """Parameter dtype (the master weights)."""
    fp8: bool = False

    @property
    def name(self) -> str:
        return "fp8" if self.fp8 else {torch.float32: "fp32", torch.bfloat16: "bf16"}[self.dtype]


def fp8_unavailable_reason() -> str | None:
    """Why FP8 drafter training cannot run here, or None when it can."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    capability = torch.cuda.get_device_capability()
    if capability < _FP8_MIN_CAPABILITY:
        return f"GPU compute capability {capability[0]}.{capability[1]} has no FP8 tensor cores (8.9+ needed)"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # not installed, or built for another torch/CUDA
        return f"Transformer Engine is not importable ({type(err).__name__}: {err})"
    return None


def resolve_precision(requested: str) -> DrafterPrecision:
    if requested not in DRAFTER_PRECISIONS:
        raise ValueError(f"drafter.precision must be one of {', '.join(DRAFTER_PRECISIONS)}, got '{requested}'")
    device = compute_device()
    on_gpu = device.type == "cuda"
    if requested == "fp32":
        return DrafterPrecision(device, torch.float32)
    if requested == "bf16":
        return DrafterPrecision(device, torch.bfloat16)
    reason = fp8_unavailable_reason()
    if requested == "fp8" and reason is not None:
        raise ValueError(f"drafter.precision fp8 cannot run here: {reason}")
    if reason is None:
        return DrafterPrecision(device, torch.bfloat16, fp8=True)
    return DrafterPrecision(device, torch.bfloat16 if on_gpu else torch.float32)


def make_linear(in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype, device, fp8: bool) -> nn.Module:
    """nn.Linear, or Transformer Engine's Linear (same ``weight``/``bias`` names) for FP8 GEMMs."""
    if not fp8:
        return nn.Linear(in_features, out_features, bias=bias, dtype=dtype, device=device)
    import transformer_engine.pytorch as te

    return te.Linear(in_features, out_features, bias=bias, params_dtype=dtype, device=device)


def autocast(precision: DrafterPrecision):
    """The context a drafter forward pass runs in: TE's fp8_autocast for FP8, nothing otherwise."""
    if not precision.fp8:
        return contextlib.nullcontext()
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format

    return te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(fp8_format=Format.HYBRID))
