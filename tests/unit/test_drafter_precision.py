"""drafter.precision: what each setting resolves to, FP8 refused with the reason where it cannot run (before
any rank starts, through the real ``tlt train``), the choice between FP8's two backends, and the torchao
backend itself, which runs on this CPU: torch 2.13 has CPU float8 kernels behind ``torch._scaled_mm``."""

import pytest
import torch

from megatron_tlt.drafter import precision as precision_module
from megatron_tlt.drafter.fp8_measured import COMPILED, EAGER, MeasuredRow, load_rows
from megatron_tlt.drafter.model import EagleDrafter
from megatron_tlt.drafter.precision import (
    TORCHAO,
    TRANSFORMER_ENGINE,
    CudaKind,
    DrafterPrecision,
    backend_import_error,
    choose_auto,
    choose_fp8_backend,
    fp8_unavailable_reason,
    resolve_precision,
    start_up_line,
)
from megatron_tlt.formats.architecture import architecture_from_dict
from tiny_models import TINY_LLAMA, next_token_fixture

LLAMA = architecture_from_dict(TINY_LLAMA)
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="what a CPU-only machine resolves to")
needs_torchao = pytest.mark.skipif(backend_import_error(TORCHAO) is not None,
                                   reason=f"torchao: {backend_import_error(TORCHAO)}")
BOTH_IMPORTABLE = {TRANSFORMER_ENGINE: None, TORCHAO: None}


@no_cuda
def test_auto_is_fp32_on_cpu_and_fp8_is_refused_with_the_reason():
    precision = resolve_precision("auto")
    assert (precision.device.type, precision.dtype, precision.fp8, precision.name) == ("cpu", torch.float32, False, "fp32")
    assert fp8_unavailable_reason() == "no CUDA device"
    with pytest.raises(ValueError, match="drafter.precision=fp8 cannot run here: no CUDA device; use "):
        resolve_precision("fp8")


def test_bf16_drafter_trains_with_the_same_tensor_names_and_an_unknown_precision_is_refused():
    precision = resolve_precision("bf16")
    drafter = EagleDrafter(LLAMA, dtype=precision.dtype, device=precision.device)
    assert all(t.dtype == torch.bfloat16 for t in drafter.export_tensors().values())
    assert set(drafter.export_tensors()) == set(EagleDrafter(LLAMA).export_tensors())
    with pytest.raises(ValueError, match="drafter.precision must be one of auto, fp32, bf16, fp8"):
        resolve_precision("fp16")


@pytest.mark.parametrize("capability, import_errors, chosen, reason", [
    (None, BOTH_IMPORTABLE, None, "no CUDA device"),
    ((8, 0), BOTH_IMPORTABLE, None, "GPU compute capability 8.0 < 8.9: no FP8 tensor cores"),
    ((8, 9), BOTH_IMPORTABLE, TRANSFORMER_ENGINE, None),
    ((9, 0), {TRANSFORMER_ENGINE: "ImportError: libcudnn.so.9", TORCHAO: None}, TORCHAO, None),
    ((10, 0), {TRANSFORMER_ENGINE: None, TORCHAO: "ModuleNotFoundError: no torchao"}, TRANSFORMER_ENGINE, None),
])
def test_fp8_takes_transformer_engine_first_then_torchao_on_a_gpu_with_fp8_tensor_cores(capability, import_errors,
                                                                                          chosen, reason):
    backend, why = choose_fp8_backend(capability, import_errors)
    assert backend == chosen
    assert (why is None) if reason is None else why.startswith(reason)


def test_without_either_backend_the_reason_names_both_import_errors():
    errors = {TRANSFORMER_ENGINE: "ModuleNotFoundError: No module named 'transformer_engine'",
              TORCHAO: "ImportError: torch._scaled_mm missing"}
    assert choose_fp8_backend((9, 0), errors) == (None, (
        "neither Transformer Engine nor torchao is importable (transformer_engine: ModuleNotFoundError: No module "
        "named 'transformer_engine'; torchao: ImportError: torch._scaled_mm missing); install torchao (the GPU "
        "extra, launch/install_gpu.sh) or Transformer Engine"))


def test_the_path_taken_is_named_for_the_log_and_summary_json():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert [p.label for p in (DrafterPrecision(cpu, torch.float32), DrafterPrecision(cuda, torch.bfloat16),
                              DrafterPrecision(cuda, torch.bfloat16, fp8_backend=TRANSFORMER_ENGINE),
                              DrafterPrecision(cuda, torch.bfloat16, fp8_backend=TORCHAO))] == [
        "fp32", "bf16", "fp8 (transformer_engine)", "fp8 (torchao)"]
    assert DrafterPrecision(cuda, torch.bfloat16, fp8_backend=TORCHAO).describe() == (
        "drafter trains in fp8 through torchao float8 (torch._scaled_mm) on cuda:0, bf16 master weights")
    assert DrafterPrecision(cpu, torch.float32).describe() == "drafter trains in fp32 on cpu"


@no_cuda
def test_the_start_up_line_says_what_auto_took_and_the_precision_says_why():
    auto = resolve_precision("auto")
    assert start_up_line("auto", auto) == "drafter trains in fp32 on cpu (drafter.precision=auto)"
    assert auto.reason == "auto: no CUDA device: fp32"
    assert resolve_precision("bf16").reason == "drafter.precision=bf16 as set"


# ------------------------------------------------------------------ auto: FP8 only where it measured faster

H200, H100 = CudaKind("NVIDIA H200", (9, 0)), CudaKind("NVIDIA H100 80GB HBM3", (9, 0))


def _row(backend: str, vs_bf16: float, *, device: str = "NVIDIA H200", compile: str = EAGER,
         date: str = "2026-12-01") -> MeasuredRow:
    return MeasuredRow(device=device, capability="9.0", backend=backend, compile=compile, vs_bf16=vs_bf16, date=date)


def _importable(backend: str) -> str | None:
    return None


def test_auto_does_not_take_fp8_on_the_h200_as_measured_and_says_why():
    """The shipped table's one row: torchao's eager float8 at 0.48x bf16 on an H200, TE never measured."""
    assert choose_auto(H200, load_rows(), _importable) == (None, (
        "auto: transformer_engine not measured in eager mode on NVIDIA H200; torchao measured 0.48x bf16 in eager "
        "mode on NVIDIA H200 (2026-11-28), under 1.05x: bf16"))


def test_auto_takes_fp8_where_the_table_says_that_backend_measured_faster_on_this_gpu():
    rows = [_row(TORCHAO, 1.42)]
    assert choose_auto(H200, rows, _importable) == (TORCHAO, (
        "auto: torchao measured 1.42x bf16 in eager mode on NVIDIA H200 (2026-12-01), >= 1.05x: fp8 (torchao)"))
    backend, reason = choose_auto(H100, rows, _importable)  # another GPU of the same capability: not measured
    assert backend is None and reason.endswith("torchao not measured in eager mode on NVIDIA H100 80GB HBM3: bf16")


@pytest.mark.parametrize("rows, compile_mode, chosen", [
    ([_row(TORCHAO, 1.04)], EAGER, None),  # faster, but within noise: under FP8_PAYS_AT
    ([_row(TORCHAO, 1.05)], EAGER, TORCHAO),
    ([_row(TORCHAO, 1.4, compile=COMPILED)], EAGER, None),  # measured compiled; the trainer runs eager
    ([_row(TORCHAO, 1.4, compile=COMPILED)], COMPILED, TORCHAO),
    ([_row(TORCHAO, 1.3), _row(TRANSFORMER_ENGINE, 1.6)], EAGER, TRANSFORMER_ENGINE),  # the fastest that pays
    ([_row(TORCHAO, 1.6), _row(TRANSFORMER_ENGINE, 1.3)], EAGER, TORCHAO),
    ([_row(TORCHAO, 1.3, date="2026-12-01"), _row(TORCHAO, 0.9, date="2026-12-05")], EAGER, None),  # the newest
])
def test_auto_takes_the_fastest_backend_measured_to_pay_in_the_trainers_mode(rows, compile_mode, chosen):
    assert choose_auto(H200, rows, _importable, compile_mode=compile_mode)[0] == chosen


def test_auto_passes_over_a_backend_that_pays_but_does_not_import_here_and_says_so():
    rows = [_row(TRANSFORMER_ENGINE, 1.6), _row(TORCHAO, 1.2)]
    te_missing = {TRANSFORMER_ENGINE: "ModuleNotFoundError: No module named 'transformer_engine'", TORCHAO: None}
    assert choose_auto(H200, rows, te_missing.get)[0] == TORCHAO
    backend, reason = choose_auto(H200, rows[:1], te_missing.get)
    assert backend is None and reason == (
        "auto: transformer_engine measured 1.60x bf16 in eager mode on NVIDIA H200 (2026-12-01) but cannot be "
        "imported here (ModuleNotFoundError: No module named 'transformer_engine'); torchao not measured in eager "
        "mode on NVIDIA H200: bf16")


def test_auto_is_fp32_without_a_gpu_and_bf16_without_fp8_tensor_cores_whatever_the_table_says():
    rows = [_row(TORCHAO, 2.0, device="NVIDIA A100-SXM4-80GB")]
    assert choose_auto(None, rows, _importable) == (None, "auto: no CUDA device: fp32")
    assert choose_auto(CudaKind("NVIDIA A100-SXM4-80GB", (8, 0)), rows, _importable) == (None, (
        "auto: NVIDIA A100-SXM4-80GB has compute capability 8.0 < 8.9, no FP8 tensor cores: bf16"))


def test_resolve_precision_goes_by_the_table_on_the_gpu_it_runs_on(monkeypatch):
    """resolve_precision on a stand-in H200 (its name and capability; nothing touches CUDA): bf16 by the shipped
    table, fp8 through torchao by a table where torchao measured faster; the start-up line quotes the reason."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(precision_module, "_cuda_kind", lambda: H200)
    monkeypatch.setattr(precision_module, "compute_device", lambda: cuda)
    monkeypatch.setattr(precision_module, "backend_import_error", _importable)
    shipped = resolve_precision("auto")
    assert (shipped.label, shipped.dtype) == ("bf16", torch.bfloat16)
    assert shipped.reason == choose_auto(H200, load_rows(), _importable)[1]
    assert start_up_line("auto", shipped) == (f"drafter trains in bf16 on cuda:0 (drafter.precision=auto); "
                                              f"{shipped.reason}")
    faster = resolve_precision("auto", measured=[_row(TORCHAO, 1.42)])
    assert (faster.label, faster.dtype, faster.reason) == ("fp8 (torchao)", torch.bfloat16, (
        "auto: torchao measured 1.42x bf16 in eager mode on NVIDIA H200 (2026-12-01), >= 1.05x: fp8 (torchao)"))
    assert resolve_precision("auto", measured=[_row(TORCHAO, 1.42, compile=COMPILED)]).label == "bf16"
    assert resolve_precision("auto", compile_mode=COMPILED,
                             measured=[_row(TORCHAO, 1.42, compile=COMPILED)]).label == "fp8 (torchao)"


@no_cuda
def test_tlt_train_refuses_fp8_without_fp8_support_before_any_rank_starts(tlt_in_process, tmp_path):
    run_dir = tmp_path / "run"
    result = tlt_in_process("train", "drafter.precision=fp8", f"trainer.run_dir={run_dir}")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-3000:]
    assert lines == ["tlt: error: drafter.precision=fp8 cannot run here: no CUDA device; use drafter.precision=bf16 "
                     "or auto"], lines
    assert not run_dir.exists()  # refused before the run directory was made, so before any rank


# ------------------------------------------------------------------------------ the torchao backend, for real


def _trainer_on_the_next_token_target(precision: DrafterPrecision):
    """A drafter trainer whose buffer holds sequences of the next-token target (``next_token_fixture``) as one
    pack of 118 rows (not a multiple of 16: FP8 pads it)."""
    from megatron_tlt.config import DrafterConfig
    from megatron_tlt.drafter.trainer import DrafterTrainer

    settings = DrafterConfig(lr=3e-3, buffer_tokens=4096, pack_tokens=1024, hidden_weight=1.0, ce_weight=0.1)
    trainer = DrafterTrainer(LLAMA, settings, seed=0, precision=precision)
    target = next_token_fixture(LLAMA)["target"]
    embed = target["model.embed_tokens.weight"]
    generator = torch.Generator().manual_seed(0)
    token_ids, features = [], []
    for length in (23, 40, 61):
        tokens = torch.randint(0, LLAMA.vocab_size, (length,), generator=generator)
        e = embed[tokens[:-1]]
        token_ids.append(tokens.tolist())
        features.append((e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + LLAMA.rms_norm_eps)).to(precision.dtype))
    trainer.set_policy_heads(target)
    trainer.add_sequences(token_ids, features)
    return trainer, token_ids, features


@needs_torchao
def test_a_torchao_fp8_drafter_trains_through_scaled_mm_and_exports_only_the_vllm_tensors(monkeypatch):
    from torchao.float8.float8_linear import Float8Linear

    scaled_mm_dtypes = set()
    real_scaled_mm = torch._scaled_mm

    def recording_scaled_mm(a, b, *args, **kwargs):  # the real kernel; only its operand dtypes are noted
        scaled_mm_dtypes.update((a.dtype, b.dtype))
        return real_scaled_mm(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording_scaled_mm)
    precision = DrafterPrecision(torch.device("cpu"), torch.bfloat16, fp8_backend=TORCHAO)
    trainer, token_ids, features = _trainer_on_the_next_token_target(precision)
    drafter = trainer.drafter
    linears = [m for m in drafter.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 8 and all(isinstance(m, Float8Linear) for m in linears)
    assert set(drafter.export_tensors()) == set(EagleDrafter(LLAMA).export_tensors())  # no torchao state
    adam_params = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert adam_params == {id(p) for p in drafter.parameters()}  # Float8Linear kept nn.Linear's parameters

    before = trainer.evaluate(token_ids, features)
    assert [trainer.micro_step() for _ in range(20)] == [118] * 20
    after = trainer.evaluate(token_ids, features)
    assert after["loss_sum"] < 0.8 * before["loss_sum"], (before, after)
    assert scaled_mm_dtypes >= {torch.float8_e4m3fn, torch.float8_e5m2}  # forward e4m3, gradients e5m2

    exported = trainer.export_tensors()
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in exported.values())
    fresh, _, _ = _trainer_on_the_next_token_target(precision)
    fresh.drafter.load_tensors(exported)  # a checkpoint restored into an fp8 drafter
    assert all(torch.equal(exported[k], v) for k, v in fresh.export_tensors().items())
