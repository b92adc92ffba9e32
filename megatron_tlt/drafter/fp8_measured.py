"""FP8 drafter training measured against bf16 on each kind of GPU: what ``drafter.precision=auto`` goes by.

``fp8_measured.json`` beside this module holds one row per (GPU name, FP8 backend, compile mode): the drafter's
training tokens/s in FP8 over bf16's in the same mode, at Llama-3.3-70B's drafter dims, as
``bench/drafter_precision.py`` measured it. ``auto`` takes FP8 through a backend only where this GPU's name has a
row for it, in the mode the trainer runs, at ``FP8_PAYS_AT`` or above (``precision.choose_auto``); anywhere else it
trains in bf16: a default does not bet on a path nobody has measured paying. The bench adds rows:

    python bench/drafter_precision.py --out fp8.json --record    # measure on this GPU, then merge into the table
    python bench/drafter_precision.py --merge fp8.json           # merge a run saved earlier (its --out)

A row for the same GPU, backend and mode replaces the older one. Rows are keyed by the GPU's name
(``torch.cuda.get_device_name``), not its compute capability: an H100 and an H200 share 9.0 but not their memory
bandwidth, and FP8 pays off only where the GEMMs, not the casts around them, bound the step.

No torch here: the bench and the tests read and write the table as plain data.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from megatron_tlt.atomic_files import write_text_atomic

TABLE = Path(__file__).resolve().with_name("fp8_measured.json")
EAGER, COMPILED = "eager", "compiled"
COMPILE_MODES = (EAGER, COMPILED)
"""How the measured step ran: eager, or its heavy regions under ``torch.compile`` (``DrafterTrainer.compile``)."""
FP8_PAYS_AT = 1.05
"""FP8 over bf16 tokens/s at or above which ``auto`` takes FP8. Not 1.0: 30 timed micro-steps measure to a few
per cent, and an FP8 path only as fast as bf16 would trade accuracy margin for nothing."""
MEASURED_DIMS = "llama-3.3-70b"
"""The drafter dims the table's rows are measured at (DESIGN.md section 5's target); runs at other dims are
not recorded: FP8's gain depends on the GEMMs' size."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeasuredRow:
    """One measurement: FP8 through ``backend`` against bf16, both in ``compile`` mode, on a ``device``."""

    device: str
    """The GPU's name, as ``torch.cuda.get_device_name`` says it (the table's key with backend and compile)."""
    capability: str
    """Its compute capability, e.g. ``9.0`` (for the reader: rows are matched by name)."""
    backend: str
    """``transformer_engine`` or ``torchao`` (``precision.FP8_BACKENDS``)."""
    compile: str
    """``eager`` or ``compiled`` (``COMPILE_MODES``)."""
    vs_bf16: float
    """FP8's tokens/s over bf16's, the same mode, the same run."""
    date: str
    """When it was measured (YYYY-MM-DD)."""
    fp8_tokens_per_s: float | None = None
    bf16_tokens_per_s: float | None = None
    dims: str = MEASURED_DIMS
    commit: str | None = None
    """The tree the bench ran on."""
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    """torch's and the backend's versions."""
    note: str = ""

    @property
    def key(self) -> tuple[str, str, str]:
        return self.device, self.backend, self.compile

    def says(self) -> str:
        """The measurement in words, as a reason string quotes it."""
        return (f"{self.backend} measured {self.vs_bf16:.2f}x bf16 {mode_in_words(self.compile)} on {self.device} "
                f"({self.date})")


def mode_in_words(compile_mode: str) -> str:
    """How a reason string names a compile mode."""
    return "in eager mode" if compile_mode == EAGER else "under torch.compile"


def load_rows(path: str | Path = TABLE) -> list[MeasuredRow]:
    """The table's rows (the shipped one by default)."""
    return [MeasuredRow(**row) for row in json.loads(Path(path).read_text())["rows"]]


def find_row(rows: list[MeasuredRow], device: str, backend: str, compile_mode: str) -> MeasuredRow | None:
    """The newest row for this GPU name, backend and mode, or None."""
    matches = [row for row in rows if row.key == (device, backend, compile_mode)]
    return max(matches, key=lambda row: row.date) if matches else None


def rows_from_report(report: dict) -> list[MeasuredRow]:
    """The FP8 rows a ``bench/drafter_precision.py --out`` report gives: each FP8 arm that ran, against the bf16 arm
    of its own mode. A report from a CPU, or at dims other than ``MEASURED_DIMS``, gives none: ``ValueError``."""
    if report.get("capability") is None:
        raise ValueError(f"the report was measured on {report.get('device')}, not a CUDA GPU: nothing to record")
    if report.get("dims") != MEASURED_DIMS:
        raise ValueError(f"the report was measured at {report.get('dims')} dims; the table holds {MEASURED_DIMS} "
                         "only (FP8's gain depends on the GEMMs' size)")
    compiled_with = (report.get("compile_backend"), report.get("compile_mode"))
    rows = []
    for arm in report["arms"]:
        if "skipped" in arm or arm.get("backend") is None or arm.get("vs_bf16") is None:
            continue
        if arm["compile"] == COMPILED and compiled_with != ("inductor", None):
            raise ValueError(f"the compiled arms ran under torch.compile(backend={compiled_with[0]}, "
                             f"mode={compiled_with[1]}), not the default a compiled trainer runs: not recorded")
        rows.append(MeasuredRow(
            device=report["device"], capability=report["capability"], backend=arm["backend"],
            compile=arm["compile"], vs_bf16=round(arm["vs_bf16"], 3), date=report["date"],
            fp8_tokens_per_s=round(arm["tokens_per_s"], 1), bf16_tokens_per_s=round(arm["bf16_tokens_per_s"], 1),
            dims=report["dims"], commit=report.get("commit"),
            versions={k: v for k, v in report.get("versions", {}).items() if k in ("torch", arm["backend"])}))
    return rows


def merge_rows(rows: list[MeasuredRow], new: list[MeasuredRow]) -> list[MeasuredRow]:
    """``rows`` with ``new`` added, each replacing a row of the same GPU, backend and mode; sorted by key."""
    merged = {row.key: row for row in rows}
    merged.update((row.key, row) for row in new)
    return [merged[key] for key in sorted(merged)]


def write_rows(rows: list[MeasuredRow], path: str | Path = TABLE) -> None:
    """Write the table (atomically), keeping its ``about`` text."""
    path = Path(path)
    about = json.loads(path.read_text()).get("about", "") if path.exists() else ""
    table = {"about": about, "rows": [dataclasses.asdict(row) for row in rows]}
    write_text_atomic(path, json.dumps(table, indent=1) + "\n")
