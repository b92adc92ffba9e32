"""The GPU kit's parts, with no download and no GPU: `launch/gpu_kit.sh --split-only` cuts a kit of small wheels
into parts no larger than asked, each with the manifest; `launch/gpu_kit_install.sh`, called once per part as on
the device, installs only once every part is there, and refuses a piece that does not match the manifest."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PART_BYTES = 12 * 1024


def _wheel(folder: Path, name: str, payload_bytes: int) -> Path:
    """A real, installable wheel of module ``name`` holding ``payload_bytes`` of incompressible data."""
    dist_info = f"{name}-1.0.dist-info"
    files = {
        f"{name}/__init__.py": f"VALUE = {name!r}\n".encode(),
        f"{name}/payload.bin": random.Random(name).randbytes(payload_bytes),
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{path},,\n" for path in [*files, f"{dist_info}/RECORD"])
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for member, data in files.items():
            archive.writestr(member, data)
        archive.writestr(f"{dist_info}/RECORD", record)
    return path


def _kit(tmp_path: Path) -> Path:
    kit = tmp_path / "kit"
    (kit / "wheels").mkdir(parents=True)
    for name, size in (("kitbig", 20 * 1024), ("kitmid", 9 * 1024), ("kitsmall", 2 * 1024)):
        _wheel(kit / "wheels", name, size)
    done = subprocess.run(["bash", "launch/gpu_kit.sh", "--split-only", str(kit)], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, GPU_KIT_PART_MIB=str(PART_BYTES / 2**20)))
    assert done.returncode == 0, done.stdout + done.stderr
    return kit


def _manifest(path: Path) -> list[list[str]]:
    header, *rows = path.read_text().splitlines()
    assert header == "part\tbytes\tsha256\tpiece\tfile"
    return [row.split("\t") for row in rows]


def _install(tmp_path: Path, *parts: Path) -> subprocess.CompletedProcess:
    """One device call: its carried folder holds ``parts`` only."""
    carried = tmp_path / f"call-{len(list(tmp_path.glob('call-*')))}"
    carried.mkdir()
    for part in parts:
        shutil.copytree(part, carried / part.name)
    env = dict(os.environ, GPU_KIT_STAGE=str(tmp_path / "stage"), GPU_KIT_SITE=str(tmp_path / "site"))
    return subprocess.run(["bash", "launch/gpu_kit_install.sh", str(carried)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=env)


def test_split_cuts_the_kit_into_parts_within_the_limit_with_a_manifest_in_each(tmp_path):
    kit = _kit(tmp_path)
    rows = _manifest(kit / "MANIFEST.tsv")
    parts = sorted(kit.glob("part-*"))
    assert [p.name for p in parts] == [f"part-{i}" for i in range(1, len(parts) + 1)] and len(parts) >= 3
    for part in parts:
        assert (part / "MANIFEST.tsv").read_text() == (kit / "MANIFEST.tsv").read_text()
        assert sum(f.stat().st_size for f in part.iterdir() if f.name != "MANIFEST.tsv") <= PART_BYTES
    for number, size, sha, piece, _ in rows:
        data = (kit / f"part-{number}" / piece).read_bytes()
        assert len(data) == int(size) and hashlib.sha256(data).hexdigest() == sha
    big = sorted(r for r in rows if r[4].startswith("kitbig"))
    assert [r[3] for r in big] == [f"{big[0][4]}.00", f"{big[0][4]}.01"]  # larger than a part: cut in two
    joined = b"".join((kit / f"part-{r[0]}" / r[3]).read_bytes() for r in big)
    assert joined == (kit / "wheels" / big[0][4]).read_bytes()


def test_install_waits_for_every_part_then_installs_once(tmp_path):
    kit = _kit(tmp_path)
    first, *rest = sorted(kit.glob("part-*"))
    waiting = _install(tmp_path, first)
    assert waiting.returncode == 3, waiting.stdout + waiting.stderr
    assert "still to carry: " + ", ".join(p.name for p in rest) in waiting.stdout
    done = _install(tmp_path, *rest)
    assert done.returncode == 0, done.stdout + done.stderr
    imported = subprocess.run([sys.executable, "-c", "import kitbig, kitmid, kitsmall; print(kitbig.VALUE)"],
                              env=dict(os.environ, PYTHONPATH=str(tmp_path / "site")), capture_output=True, text=True)
    assert imported.stdout.strip() == "kitbig", imported.stderr
    again = _install(tmp_path, first)
    assert again.returncode == 0 and "already installed" in again.stdout


def test_install_refuses_a_piece_that_does_not_match_the_manifest(tmp_path):
    kit = _kit(tmp_path)
    parts = sorted(kit.glob("part-*"))
    piece = next(f for f in parts[-1].iterdir() if f.name != "MANIFEST.tsv")
    data = piece.read_bytes()
    piece.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    refused = _install(tmp_path, *parts)
    assert refused.returncode == 1
    assert f"do not match the manifest: {piece.name} (part {len(parts)})" in refused.stderr
    assert not (tmp_path / "site").exists()
