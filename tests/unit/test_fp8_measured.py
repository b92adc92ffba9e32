"""The table of FP8 drafter training measured against bf16 (drafter/fp8_measured.json), which
``drafter.precision=auto`` goes by: the shipped rows, a bench report turned into rows and merged, and the bench
itself (bench/drafter_precision.py) rehearsed on this CPU at the tiny Llama's dims, its compiled arm included."""

import json
import sys

import pytest

from megatron_tlt.drafter.fp8_measured import (
    COMPILE_MODES,
    COMPILED,
    EAGER,
    MEASURED_DIMS,
    TABLE,
    find_row,
    load_rows,
    merge_rows,
    rows_from_report,
    write_rows,
)
from megatron_tlt.drafter.precision import FP8_BACKENDS
from script_modules import load_script

def _bench():
    return load_script("bench/drafter_precision.py", "drafter_precision_bench")


def _arm(backend, compile_mode, tokens_per_s, **more):
    return {"arm": "-", "backend": backend, "compile": compile_mode, "tokens_per_s": tokens_per_s, **more}


def _h200_report(**overrides) -> dict:
    """A report as the bench writes it on a GPU (--out): bf16 and torchao, eager and compiled; TE skipped."""
    arms = [_arm(None, EAGER, 22000.0), {"arm": "fp8 (transformer_engine)", "backend": "transformer_engine",
                                         "compile": EAGER, "skipped": "transformer_engine is not importable"},
            _arm("torchao", EAGER, 11000.0), _arm(None, COMPILED, 25000.0), _arm("torchao", COMPILED, 35000.0)]
    _bench().compare_arms(arms)
    report = {"device": "NVIDIA H200", "capability": "9.0", "dims": MEASURED_DIMS, "date": "2026-12-01",
              "commit": "abc1234", "compile_backend": "inductor", "compile_mode": None,
              "versions": {"torch": "2.13.0", "torchao": "0.18.0"}, "arms": arms}
    return {**report, **overrides}


def test_the_shipped_table_holds_the_h200s_eager_torchao_measurement_and_only_known_keys():
    rows = load_rows()
    assert all(row.backend in FP8_BACKENDS and row.compile in COMPILE_MODES and row.dims == MEASURED_DIMS
               for row in rows)
    h200 = find_row(rows, "NVIDIA H200", "torchao", EAGER)
    assert (h200.vs_bf16, h200.date, h200.capability) == (0.48, "2026-11-28", "9.0")
    assert len({row.key for row in rows}) == len(rows)
    assert json.loads(TABLE.read_text())["about"]


def test_a_gpu_report_gives_one_row_per_fp8_arm_against_the_bf16_arm_of_its_own_mode():
    report = _h200_report()
    eager, compiled = rows_from_report(report)
    assert (eager.backend, eager.compile, eager.vs_bf16, eager.bf16_tokens_per_s) == ("torchao", EAGER, 0.5, 22000.0)
    assert (compiled.compile, compiled.vs_bf16, compiled.bf16_tokens_per_s) == (COMPILED, 1.4, 25000.0)
    assert compiled.says() == "torchao measured 1.40x bf16 under torch.compile on NVIDIA H200 (2026-12-01)"
    assert (compiled.commit, compiled.versions) == ("abc1234", {"torch": "2.13.0", "torchao": "0.18.0"})
    assert report["arms"][2]["vs_bf16_compiled"] == pytest.approx(11000 / 25000)  # side by side in the printout


@pytest.mark.parametrize("overrides, refusal", [
    ({"device": "cpu", "capability": None}, "measured on cpu, not a CUDA GPU"),
    ({"dims": "tiny"}, "measured at tiny dims"),
    ({"compile_backend": "aot_eager"}, "torch.compile(backend=aot_eager, mode=None), not the default"),
])
def test_a_report_from_a_cpu_small_dims_or_another_compile_backend_gives_no_rows(overrides, refusal):
    with pytest.raises(ValueError, match=refusal.replace("(", r"\(").replace(")", r"\)")):
        rows_from_report(_h200_report(**overrides))


def test_merging_replaces_the_row_of_the_same_gpu_backend_and_mode_and_keeps_the_rest(tmp_path):
    table = tmp_path / "fp8_measured.json"
    table.write_text(TABLE.read_text())
    _bench().record(_h200_report(), table)  # what --record and --merge do
    rows = load_rows(table)
    assert [(row.backend, row.compile, row.vs_bf16) for row in rows] == [("torchao", COMPILED, 1.4),
                                                                         ("torchao", EAGER, 0.5)]
    assert json.loads(table.read_text())["about"] == json.loads(TABLE.read_text())["about"]
    older = load_rows()[0]
    assert merge_rows(rows, [older]) == sorted([older, rows[0]], key=lambda row: row.key)
    write_rows([], table)
    assert load_rows(table) == []


def test_the_bench_rehearses_its_eager_and_compiled_arms_on_cpu_and_skips_fp8_saying_why(tmp_path, monkeypatch,
                                                                                          capsys):
    """The tiny Llama's dims, a few micro-steps, the compiled arm through aot_eager (the graphs torch.compile
    captures, run without code generation); seconds of CPU time."""
    out = tmp_path / "report.json"
    bench = _bench()
    monkeypatch.setattr(sys, "argv", ["drafter_precision.py", "--device", "cpu", "--small", "--packs", "2",
                                      "--warmup", "2", "--steps", "2", "--pack-tokens", "64",
                                      "--arms", "bf16,fp8-torchao,bf16-compiled,fp8-torchao-compiled",
                                      "--compile-backend", "aot_eager", "--out", str(out)])
    bench.main()
    report = json.loads(out.read_text())
    arms = {arm["name"]: arm for arm in report["arms"]}
    assert list(arms) == ["bf16", "fp8-torchao", "bf16-compiled", "fp8-torchao-compiled"]
    for name in ("fp8-torchao", "fp8-torchao-compiled"):
        assert arms[name]["skipped"] == "--device cpu: FP8 runs on a CUDA device of capability 8.9+"
    eager, compiled = arms["bf16"], arms["bf16-compiled"]
    assert eager["tokens_per_s"] > 0 and compiled["tokens_per_s"] > 0
    assert compiled["vs_bf16"] == 1.0 and compiled["vs_bf16_eager"] == compiled["tokens_per_s"] / eager["tokens_per_s"]
    assert compiled["loss_after"] == pytest.approx(eager["loss_after"], rel=1e-2)  # the same training, compiled
    assert (report["device"], report["capability"], report["dims"]) == ("cpu", None, "tiny")
    printed = capsys.readouterr().out
    assert "bf16 compiled" in printed and "vs bf16 comp." in printed and "skipped: --device cpu" in printed

    monkeypatch.setattr(sys, "argv", ["drafter_precision.py", "--merge", str(out), "--table", str(tmp_path / "t.json")])
    with pytest.raises(SystemExit, match="measured on cpu, not a CUDA GPU: nothing to record"):
        bench.main()
