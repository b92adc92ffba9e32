"""drafter.precision: what each setting resolves to, FP8 refused with the reason where it cannot run (before
any rank starts, through the real ``tlt train``), the choice between FP8's two backends, and the torchao
backend itself, which runs on this CPU: torch 2.13 has CPU float8 kernels behind ``torch._scaled_mm``."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_tlt.drafter.model import EagleDrafter
from megatron_tlt.drafter.precision import (
    TORCHAO,
    TRANSFORMER_ENGINE,
    DrafterPrecision,
    backend_import_error,
    choose_fp8_backend,
    fp8_unavailable_reason,
    resolve_precision,
)
from megatron_tlt.formats.architecture import architecture_from_dict
from megatron_tlt.model.tiny_models import TINY_LLAMA, next_token_fixture

REPO = Path(__file__).resolve().parents[2]
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
def test_the_start_up_line_says_what_auto_took():
    from megatron_tlt.drafter.precision import start_up_line

    assert start_up_line("auto", resolve_precision("auto")) == "drafter trains in fp32 on cpu (drafter.precision=auto)"


@no_cuda
def test_tlt_train_refuses_fp8_without_fp8_support_before_any_rank_starts(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "megatron_tlt.cli", "train", "drafter.precision=fp8",
                             f"trainer.run_dir={run_dir}"], cwd=REPO, capture_output=True, text=True, timeout=120)
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
