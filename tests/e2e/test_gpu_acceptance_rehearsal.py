"""launch/gpu_acceptance.sh rehearsed on a CPU machine (`rehearse`: the same script, its GPU parts at tiny sizes):
a part that passes, a part interrupted at its limit, parts left out for lack of budget, each said in its log and
the summary, and the exit status 0 only when every part run passed. The cheap parts run here; the end-to-end
bench only starts, to be interrupted (two `tlt train` runs take minutes on two cores)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
PARTS = ["gpu_tests_kernels", "gpu_tests_engine", "gpu_tests_tlt_train", "tlt_end_to_end", "drafter_precision",
         "weight_sync"]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="rehearses the GPU script on a CPU machine")


def _rehearse(out: Path, **env: str) -> tuple[subprocess.CompletedProcess, dict[str, dict[str, str]]]:
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_ACCEPTANCE_", "E2E_"))}
    done = subprocess.run(["bash", "launch/gpu_acceptance.sh", "rehearse", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=dict(run_env, **env))  # a hang guard only
    header, *lines = (out / "summary.tsv").read_text().splitlines()
    columns = header.split("\t")
    rows = {line.split("\t")[0]: dict(zip(columns, line.split("\t"))) for line in lines}
    return done, rows


def test_parts_that_pass_leave_their_logs_and_figures_and_the_run_exits_zero(tmp_path):
    done, rows = _rehearse(tmp_path, GPU_ACCEPTANCE_PARTS="gpu_tests_kernels,drafter_precision")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert list(rows) == PARTS  # the phase's parts in issue 49's order, every one accounted for
    assert rows["gpu_tests_kernels"]["status"] == rows["drafter_precision"]["status"] == "passed"
    assert {rows[p]["status"] for p in PARTS[1:4] + PARTS[5:]} == {"not selected"}
    assert rows["gpu_tests_engine"]["h200_2026_11_28"] == "112 s"
    suite_log = (tmp_path / "gpu_tests_kernels.log").read_text()
    assert "needs cuda: no CUDA device" in suite_log and " skipped in " in suite_log  # skipped, not failed
    assert "bf16" in (tmp_path / "drafter_precision.log").read_text()
    assert (tmp_path / "drafter_precision.json").is_file()
    assert "torch" in (tmp_path / "environment.log").read_text()


def test_a_part_past_its_limit_is_interrupted_and_fails_the_run(tmp_path):
    done, rows = _rehearse(tmp_path, GPU_ACCEPTANCE_PARTS="tlt_end_to_end", E2E_SECONDS="3")
    assert done.returncode == 1
    row = rows["tlt_end_to_end"]
    assert (row["status"], row["exit"], row["limit"]) == ("timed out", "124", "3"), row
    assert int(row["seconds"]) < 3 + 10 + 5  # its limit, the grace before SIGKILL, and slack
    assert (tmp_path / "tlt_end_to_end.log").is_file()
    assert "== tlt_end_to_end: timed out (exit 124)" in done.stdout


def test_parts_beyond_the_budget_are_skipped_and_fail_the_run(tmp_path):
    done, rows = _rehearse(tmp_path, GPU_ACCEPTANCE_SECONDS="0")
    assert done.returncode == 1
    assert {row["status"] for row in rows.values()} == {"skipped (budget)"} and list(rows) == PARTS
    assert sorted(p.name for p in tmp_path.glob("*.log")) == ["environment.log"]  # no part ran
