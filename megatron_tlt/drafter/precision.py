"""Where and in what precision the drafter trains: fp32 on CPU; bf16 on GPU; or FP8 on Ada/Hopper GPUs.

``drafter.precision``:
  * ``fp32`` / ``bf16``: plain torch;
  * ``fp8``: asked for explicitly, so refused with the reason where it cannot run: ``tlt train`` refuses it
    before any rank starts (``check_runs_here``) and each rank again when it builds its drafter;
  * ``auto``: FP8 only where it measured faster: through a backend that ``fp8_measured.json`` has a row for, on
    this GPU (by name), in the mode the trainer runs (eager: ``tlt train`` does not compile the drafter), at
    ``fp8_measured.FP8_PAYS_AT`` (1.05x bf16) or above, the fastest such backend that imports; else bf16 on GPU,
    fp32 on CPU. Transformer Engine too needs its row: nobody has measured it pay here yet, and torchao's
    eager float8, which everyone expected to, measured 0.48x bf16 on an H200 (bench/RESULTS.md). The table's
    rows come from ``bench/drafter_precision.py --record``.
The run says which path it took and why: a log line at start, ``drafter/precision`` and ``drafter/precision_reason``
in summary.json (``DrafterPrecision.reason``, e.g. "auto: torchao measured 0.48x bf16 in eager mode on NVIDIA H200
(2026-11-28), under 1.05x; transformer_engine not measured ...: bf16"), so nothing runs in bf16 unannounced.

FP8 needs a CUDA device of compute capability 8.9+ (FP8 tensor cores, ``torch._scaled_mm``) and one of two
backends; ``fp8`` takes the first importable one in this order:
  * ``transformer_engine``: the drafter's linear layers are ``te.Linear`` and its forward runs inside
    ``fp8_autocast`` (delayed scaling, HYBRID: e4m3 forward, e5m2 gradients);
  * ``torchao``: the drafter is built of plain ``nn.Linear`` and ``torchao.float8.convert_to_float8_training``
    swaps each for a ``Float8Linear`` (dynamic tensorwise scaling, the same parameters) whose GEMMs go through
    ``torch._scaled_mm``; no autocast context. It is pure Python over torch: no build, unlike TE's torch part.
    Eager, its casts and scales run as separate kernels around each GEMM; ``torch.compile`` fuses them
    (``DrafterTrainer.compile``, which the bench's compiled arms use).
Either way the parameters keep nn.Linear's names (``weight``, ``bias``), so ``export_tensors`` and the drafter
checkpoints hold vLLM's tensors and nothing else; packs are padded to 16 rows for both (``trainer.row_multiple``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from megatron_tlt.config import DRAFTER_PRECISIONS, ConfigError
from megatron_tlt.device import compute_device
from megatron_tlt.drafter.fp8_measured import (COMPILE_MODES, EAGER, FP8_PAYS_AT, MeasuredRow, find_row, load_rows,
                                               mode_in_words)

logger = logging.getLogger(__name__)

FP8_MIN_CAPABILITY = (8, 9)
TRANSFORMER_ENGINE, TORCHAO = "transformer_engine", "torchao"
FP8_BACKENDS = (TRANSFORMER_ENGINE, TORCHAO)
"""In order of preference: TE's fused FP8 kernels where it is built, torchao's float8 training otherwise."""
_BACKEND_MODULES = {TRANSFORMER_ENGINE: "transformer_engine.pytorch", TORCHAO: "torchao.float8"}
_BACKEND_WAYS = {TRANSFORMER_ENGINE: "Transformer Engine (te.Linear in fp8_autocast)",
                 TORCHAO: "torchao float8 (torch._scaled_mm)"}
_FP8_DIM_MULTIPLE = 16
"""FP8 GEMMs need both dims of every weight divisible by 16."""


@dataclasses.dataclass(frozen=True)
class DrafterPrecision:
    device: torch.device
    dtype: torch.dtype
    """Parameter dtype (the master weights)."""
    fp8_backend: str | None = None
    """None, or one of ``FP8_BACKENDS``: the drafter's GEMMs run in FP8 through it."""
    reason: str = dataclasses.field(default="", compare=False)
    """Why this path: the setting as given, or what ``auto`` went by (summary.json's ``drafter/precision_reason``)."""

    def __post_init__(self) -> None:
        assert self.fp8_backend in (None, *FP8_BACKENDS), self.fp8_backend
        assert self.fp8_backend is None or self.dtype == torch.bfloat16, "FP8 keeps bf16 master weights"

    @property
    def fp8(self) -> bool:
        return self.fp8_backend is not None

    @property
    def name(self) -> str:
        return "fp8" if self.fp8 else {torch.float32: "fp32", torch.bfloat16: "bf16"}[self.dtype]

    @property
    def label(self) -> str:
        """The path taken, as summary.json's ``drafter/precision`` says it: fp32, bf16, fp8 (torchao), ..."""
        return f"fp8 ({self.fp8_backend})" if self.fp8 else self.name

    def describe(self) -> str:
        """The start-up log line's sentence."""
        if self.fp8:
            way = _BACKEND_WAYS[self.fp8_backend]
            return f"drafter trains in fp8 through {way} on {self.device}, bf16 master weights"
        return f"drafter trains in {self.name} on {self.device}"


# ------------------------------------------------------------------------------------ what this machine offers

class CudaKind(NamedTuple):
    """The kind of GPU a rank computes on: what ``fp8_measured.json``'s rows are matched by (the name)."""

    name: str
    capability: tuple[int, int]


def choose_fp8_backend(capability: tuple[int, int] | None, import_errors: dict[str, str | None]
                       ) -> tuple[str | None, str | None]:
    """``(backend, None)`` where FP8 can run, else ``(None, reason)``. Pure: ``capability`` is the CUDA device's
    compute capability (None: no CUDA device), ``import_errors`` each backend's import error (None: importable)."""
    if capability is None:
        return None, "no CUDA device"
    if tuple(capability) < FP8_MIN_CAPABILITY:
        return None, (f"GPU compute capability {capability[0]}.{capability[1]} < {FP8_MIN_CAPABILITY[0]}."
                      f"{FP8_MIN_CAPABILITY[1]}: no FP8 tensor cores (Ada, Hopper and later have them)")
    for backend in FP8_BACKENDS:
        if import_errors[backend] is None:
            return backend, None
    errors = "; ".join(f"{backend}: {import_errors[backend]}" for backend in FP8_BACKENDS)
    return None, (f"neither Transformer Engine nor torchao is importable ({errors}); "
                  "install torchao (the GPU extra, launch/install_gpu.sh) or Transformer Engine")


@functools.cache
def backend_import_error(backend: str) -> str | None:
    """Why ``backend`` cannot be imported here, or None (cached: an import is tried once per process)."""
    try:
        __import__(_BACKEND_MODULES[backend])
    except Exception as err:  # not installed, or built for another torch/CUDA
        return f"{type(err).__name__}: {err}"
    return None


def _cuda_kind() -> CudaKind | None:
    """This process's CUDA device's name and compute capability (None: no CUDA device)."""
    if not torch.cuda.is_available():
        return None
    device = compute_device()
    return CudaKind(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))


def _cuda_capability() -> tuple[int, int] | None:
    """The compute capability of this process's CUDA device (None: no CUDA device)."""
    kind = _cuda_kind()
    return kind.capability if kind is not None else None


def choose_auto(gpu: CudaKind | None, rows: list[MeasuredRow], import_error: Callable[[str], str | None], *,
                compile_mode: str = EAGER) -> tuple[str | None, str]:
    """What ``drafter.precision=auto`` takes: ``(backend, reason)`` with backend None for bf16 on a GPU (fp32
    without one). Pure: ``gpu`` is the CUDA device (None: none), ``rows`` the measured table, ``import_error``
    a backend's import error (None: importable; asked only of backends measured to pay here). FP8 is taken
    through the backend whose row for this GPU name and ``compile_mode`` is the fastest at ``FP8_PAYS_AT`` or
    above and that imports; the reason quotes that row, or says of every backend why not."""
    assert compile_mode in COMPILE_MODES, compile_mode
    if gpu is None:
        return None, "auto: no CUDA device: fp32"
    if tuple(gpu.capability) < FP8_MIN_CAPABILITY:
        return None, (f"auto: {gpu.name} has compute capability {gpu.capability[0]}.{gpu.capability[1]} < "
                      f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}, no FP8 tensor cores: bf16")
    measured = {backend: find_row(rows, gpu.name, backend, compile_mode) for backend in FP8_BACKENDS}
    paying = sorted((row for row in measured.values() if row is not None and row.vs_bf16 >= FP8_PAYS_AT),
                    key=lambda row: -row.vs_bf16)
    errors = {}
    for row in paying:
        errors[row.backend] = import_error(row.backend)
        if errors[row.backend] is None:
            return row.backend, f"auto: {row.says()}, >= {FP8_PAYS_AT}x: fp8 ({row.backend})"
    why_not = []
    for backend, row in measured.items():
        if row is None:
            why_not.append(f"{backend} not measured {mode_in_words(compile_mode)} on {gpu.name}")
        elif row.vs_bf16 < FP8_PAYS_AT:
            why_not.append(f"{row.says()}, under {FP8_PAYS_AT}x")
        else:
            why_not.append(f"{row.says()} but cannot be imported here ({errors[backend]})")
    return None, f"auto: {'; '.join(why_not)}: bf16"


def detect_fp8_backend() -> tuple[str | None, str | None]:
    """``choose_fp8_backend`` for this machine. A backend is imported only on a GPU with FP8 tensor cores, and
    torchao only where Transformer Engine is not importable."""
    capability = _cuda_capability()
    if capability is None or capability < FP8_MIN_CAPABILITY:
        return choose_fp8_backend(capability, {})
    import_errors: dict[str, str | None] = {}
    for backend in FP8_BACKENDS:
        import_errors[backend] = backend_import_error(backend)
        if import_errors[backend] is None:
            break
    return choose_fp8_backend(capability, import_errors)


def fp8_unavailable_reason() -> str | None:
    """Why FP8 drafter training cannot run here, or None when it can."""
    return detect_fp8_backend()[1]


def fp8_backend_unavailable_reason(backend: str) -> str | None:
    """Why FP8 through ``backend`` in particular cannot run here, or None (the GPU tests and the benchmark run
    each backend there is, not only the one ``auto`` and ``fp8`` take)."""
    capability = _cuda_capability()
    if capability is None or capability < FP8_MIN_CAPABILITY:
        return choose_fp8_backend(capability, {})[1]
    error = backend_import_error(backend)
    return None if error is None else f"{backend} is not importable ({error})"


def check_runs_here(requested: str) -> None:
    """Refuse a ``drafter.precision`` this machine cannot run (``ConfigError``): an unknown name, or fp8 without
    FP8 support. ``tlt train`` calls it before any rank starts; ``resolve_precision`` again in every rank."""
    if requested not in DRAFTER_PRECISIONS:
        raise ConfigError(f"drafter.precision must be one of {', '.join(DRAFTER_PRECISIONS)}, got '{requested}'")
    if requested == "fp8" and (reason := fp8_unavailable_reason()) is not None:
        raise ConfigError(f"drafter.precision=fp8 cannot run here: {reason}; use drafter.precision=bf16 or auto")


def resolve_precision(requested: str, *, compile_mode: str = EAGER,
                      measured: list[MeasuredRow] | None = None) -> DrafterPrecision:
    """The path ``drafter.precision=requested`` takes on this rank's device, with the reason. ``compile_mode``:
    how the trainer will run (``tlt train`` and ``tlt warmup-drafter``: eager), the mode of the measured rows
    ``auto`` goes by; ``measured``: those rows (default: the shipped ``fp8_measured.json``)."""
    check_runs_here(requested)
    device = compute_device()
    if requested in ("fp32", "bf16"):
        dtype = torch.float32 if requested == "fp32" else torch.bfloat16
        return DrafterPrecision(device, dtype, reason=f"drafter.precision={requested} as set")
    if requested == "fp8":  # checked above: it runs here
        backend, _ = detect_fp8_backend()
        passed_over = [f"{b} not importable" for b in FP8_BACKENDS[:FP8_BACKENDS.index(backend)]]
        return DrafterPrecision(device, torch.bfloat16, fp8_backend=backend,
                                reason=", ".join([f"drafter.precision=fp8 as set: through {backend}", *passed_over]))
    backend, reason = choose_auto(_cuda_kind(), load_rows() if measured is None else measured, backend_import_error,
                                  compile_mode=compile_mode)
    if backend is not None:
        return DrafterPrecision(device, torch.bfloat16, fp8_backend=backend, reason=reason)
    return DrafterPrecision(device, torch.bfloat16 if device.type == "cuda" else torch.float32, reason=reason)


def start_up_line(requested: str, precision: DrafterPrecision) -> str:
    """What rank 0 logs as the drafter is built: the path taken and, on a GPU with ``auto``, why."""
    line = f"{precision.describe()} (drafter.precision={requested})"
    if requested == "auto" and precision.device.type == "cuda":
        line += f"; {precision.reason}"
    return line


# ------------------------------------------------------------------------------------ building and running

def make_linear(in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype, device,
                fp8_backend: str | None = None) -> nn.Module:
    """nn.Linear, or Transformer Engine's Linear (same ``weight``/``bias`` names) for TE's FP8 GEMMs. torchao's
    layers are swapped in once the whole drafter is built (``convert_to_fp8``)."""
    if fp8_backend != TRANSFORMER_ENGINE:
        return nn.Linear(in_features, out_features, bias=bias, dtype=dtype, device=device)
    import transformer_engine.pytorch as te

    return te.Linear(in_features, out_features, bias=bias, params_dtype=dtype, device=device)


def convert_to_fp8(module: nn.Module, fp8_backend: str | None) -> None:
    """With torchao: swap ``module``'s nn.Linear children for Float8Linear in place, keeping their parameters
    (an optimizer made afterwards or before sees the same tensors). A linear whose dims are not multiples of 16
    stays in bf16, with a warning; none converted at all is an error, not a bf16 run called fp8."""
    if fp8_backend != TORCHAO:
        return
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    linears = {name for name, m in module.named_modules() if isinstance(m, nn.Linear)}
    left_out = sorted(name for name, m in module.named_modules() if isinstance(m, nn.Linear)
                      and any(dim % _FP8_DIM_MULTIPLE for dim in m.weight.shape))
    if linears and len(left_out) == len(linears):
        raise ValueError(f"no linear layer of the drafter has dims divisible by {_FP8_DIM_MULTIPLE}: it cannot "
                         "train in fp8; use drafter.precision=bf16")
    if left_out:
        logger.warning("fp8 (torchao): %s stay in bf16 (dims not divisible by %d)", ", ".join(left_out),
                       _FP8_DIM_MULTIPLE)
    convert_to_float8_training(module, config=Float8LinearConfig(),
                               module_filter_fn=lambda m, name: name not in left_out)


def autocast(precision: DrafterPrecision):
    """The context a drafter forward pass runs in: TE's fp8_autocast for TE's FP8, nothing otherwise (torchao's
    Float8Linear casts by itself)."""
    if precision.fp8_backend != TRANSFORMER_ENGINE:
        return contextlib.nullcontext()
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format

    return te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(fp8_format=Format.HYBRID))
