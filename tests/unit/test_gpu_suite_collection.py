"""On a machine without CUDA the GPU suite is still collected, test by test, and every test is skipped
with the reason it cannot run (tests/gpu/conftest.py): nothing in it silently disappears."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hang_guard import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]
GPU_SUITE = REPO / "tests" / "gpu"
SKIP_LINE = re.compile(r"^SKIPPED \[(\d+)\] (tests/gpu/[^:]+)(?::\d+)?: (.+)$")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA reports")


def _pytest_on_the_gpu_suite(*args: str) -> list[str]:
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", *args, "tests/gpu"], cwd=REPO,
                            capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.splitlines()


@pytest.fixture(scope="module")
def collected() -> list[str]:
    return [line for line in _pytest_on_the_gpu_suite("--collect-only") if "::" in line]


def test_every_gpu_test_module_is_collected_without_cuda(collected):
    modules = {line.split("::")[0] for line in collected}
    assert modules == {str(p.relative_to(REPO)) for p in GPU_SUITE.glob("test_*.py")}


def test_every_gpu_test_is_skipped_with_the_reason_it_cannot_run(collected):
    lines = _pytest_on_the_gpu_suite("-rs")
    skips = [SKIP_LINE.match(line) for line in lines if line.startswith("SKIPPED")]
    assert skips and all(skips), lines
    assert sum(int(m.group(1)) for m in skips) == len(collected)
    assert all(m.group(3).startswith("needs cuda: no CUDA device") for m in skips), [m.group(3) for m in skips]
    assert lines[-1].startswith(f"{len(collected)} skipped in "), lines[-1]  # and nothing passed, failed or erred
