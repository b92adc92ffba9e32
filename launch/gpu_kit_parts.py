"""The GPU kit cut into parts that each fit one device call's transfer, and put back together there.

    python3 launch/gpu_kit_parts.py split WHEELS KIT --part-bytes N   # here: KIT/part-1 ... with MANIFEST.tsv
    python3 launch/gpu_kit_parts.py assemble STAGE WHEELS             # there: verify, join the pieces into WHEELS

MANIFEST.tsv (a copy in every part) has one row per piece: the part that carries it, its bytes, its sha256, its
name, and the file it makes: a file larger than a part is cut into pieces FILE.00, FILE.01, ... joined in order.
``assemble`` checks every piece in STAGE against the manifest; while parts are missing it names them and exits 3,
so the calls that carry them can come one after another. Standard library only: the device runs it too.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
from pathlib import Path

MANIFEST = "MANIFEST.tsv"
HEADER = "part\tbytes\tsha256\tpiece\tfile"
MISSING_PARTS = 3  # assemble's exit status while parts are still to come


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _project(wheel: str) -> str:
    """A wheel's project name, normalised (PEP 427: the name's '-' are written '_')."""
    return wheel.split("-", 1)[0].lower().replace(".", "_")


def _pieces(path: Path, part_bytes: int) -> list[tuple[str, int, int]]:
    """(piece name, offset, length) of ``path``: itself, or cut into pieces of at most ``part_bytes``."""
    size = path.stat().st_size
    if size <= part_bytes:
        return [(path.name, 0, size)]
    count = -(-size // part_bytes)
    width = max(2, len(str(count - 1)))  # equal widths: the pieces sort in the order they join
    return [(f"{path.name}.{i:0{width}d}", i * part_bytes, min(part_bytes, size - i * part_bytes))
            for i in range(count)]


def split(wheels: Path, kit: Path, part_bytes: int) -> list[list[str]]:
    """Cut the wheels in ``wheels`` into parts kit/part-N of at most ``part_bytes`` each; the manifest rows."""
    files = sorted(wheels.glob("*.whl"))
    projects = [_project(f.name) for f in files]
    if duplicates := sorted({p for p in projects if projects.count(p) > 1}):
        raise SystemExit(f"two wheels of {', '.join(duplicates)} in {wheels}: pip refuses to install both")
    for old in kit.glob("part-*"):  # a kit is split afresh, never on top of an older one
        shutil.rmtree(old)
    pieces = [(f, *piece) for f in files for piece in _pieces(f, part_bytes)]
    pieces.sort(key=lambda p: -p[3])  # first fit, largest first
    room: list[int] = []
    rows = []
    for source, name, offset, length in pieces:
        part = next((i for i, free in enumerate(room) if free >= length), None)
        if part is None:
            room.append(part_bytes)
            part = len(room) - 1
        room[part] -= length
        target = kit / f"part-{part + 1}" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(source, "rb") as src, open(target, "wb") as dst:
            src.seek(offset)
            dst.write(src.read(length))
        rows.append([str(part + 1), str(length), _sha256(target), name, source.name])
    rows.sort(key=lambda r: (int(r[0]), r[3]))
    text = "\n".join([HEADER, *("\t".join(r) for r in rows)]) + "\n"
    (kit / MANIFEST).write_text(text)
    for part in range(1, len(room) + 1):
        (kit / f"part-{part}" / MANIFEST).write_text(text)
    return rows


def read_manifest(path: Path) -> list[list[str]]:
    lines = path.read_text().splitlines()
    if not lines or lines[0] != HEADER:
        raise SystemExit(f"{path}: not a kit manifest (first line must be {HEADER!r})")
    return [line.split("\t") for line in lines[1:] if line]


def assemble(stage: Path, wheels: Path) -> int:
    """Verify the pieces in ``stage`` and join them into ``wheels``; 0, or MISSING_PARTS, or 1 for a bad piece."""
    rows = read_manifest(stage / MANIFEST)
    missing_parts, bad = set(), []
    for part, size, sha, piece, _ in rows:
        path = stage / piece
        if not path.exists():
            missing_parts.add(int(part))
        elif path.stat().st_size != int(size) or _sha256(path) != sha:
            bad.append(f"{piece} (part {part})")
    if bad:
        print(f"gpu_kit_parts: these pieces do not match the manifest: {', '.join(bad)}; carry their parts again",
              file=sys.stderr)
        return 1
    parts = sorted({int(r[0]) for r in rows})
    if missing_parts:
        print(f"gpu_kit_parts: staged {len(parts) - len(missing_parts)} of {len(parts)} parts; still to carry: "
              + ", ".join(f"part-{p}" for p in sorted(missing_parts)))
        return MISSING_PARTS
    wheels.mkdir(parents=True, exist_ok=True)
    for file in dict.fromkeys(r[4] for r in rows):  # in manifest order; pieces sort as they join
        with open(wheels / file, "wb") as out:
            for piece in sorted(r[3] for r in rows if r[4] == file):
                with open(stage / piece, "rb") as src:
                    shutil.copyfileobj(src, out)
    print(f"gpu_kit_parts: all {len(parts)} parts verified; {len(set(r[4] for r in rows))} wheels in {wheels}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    cut = commands.add_parser("split")
    cut.add_argument("wheels", type=Path)
    cut.add_argument("kit", type=Path)
    cut.add_argument("--part-bytes", type=int, required=True)
    join = commands.add_parser("assemble")
    join.add_argument("stage", type=Path)
    join.add_argument("wheels", type=Path)
    args = parser.parse_args()
    if args.command == "assemble":
        return assemble(args.stage, args.wheels)
    rows = split(args.wheels, args.kit, args.part_bytes)
    for part in sorted({int(r[0]) for r in rows}):
        size = sum(int(r[1]) for r in rows if int(r[0]) == part)
        count = sum(int(r[0]) == part for r in rows)
        print(f"part-{part}: {size / 2**20:.1f} MiB in {count} piece{'s' * (count != 1)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
