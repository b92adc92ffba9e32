"""The tiny default's starting point, shipped with the package: its warmed-up policy and cold-start drafter.

Both are made by the code (``rl/tiny/tiny_source.py``, ``tlt warmup-drafter``) and cached under a key of
everything that made them (``artifact_cache.cache_key``). Making them takes ~70 minutes on a 2-core CPU
for the default's 64-layer policy, and floating-point sums differ between machines, so a run on another
machine would start elsewhere. The package therefore carries copies of the default's two cache
entries, byte for byte, with a manifest of their checksums: a run whose cache key matches a shipped
entry installs that copy into its cache instead of making it. Any other shape, or
``warmup.use_shipped=false``, makes its own. ``python -m checkpoints_tools.ship_tiny_default``
remakes the copies from the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

from megatron_tlt import atomic_files

logger = logging.getLogger(__name__)

SHIPPED_DIR = Path(__file__).with_name("shipped")
MANIFEST = "MANIFEST.json"


class ShippedEntryError(RuntimeError):
    """A shipped entry does not match its manifest (a partial checkout or an edited file)."""


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_manifest(root: Path = SHIPPED_DIR) -> dict:
    """{"entries": {name: {relative path: sha256}}, "made_by": ...}; empty when nothing is shipped."""
    path = root / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {"entries": {}}


def entry_files(entry: Path) -> dict[str, str]:
    """Every file of a cache entry, by path relative to it, with its sha256."""
    return {str(p.relative_to(entry)): file_digest(p) for p in sorted(entry.rglob("*")) if p.is_file()}


def install(final: Path, root: Path = SHIPPED_DIR) -> bool:
    """Copy the shipped entry named like ``final`` (a cache entry ``policy-<key>`` / ``drafter-<key>``)
    to ``final``, checked against the manifest; False when none is shipped under that name."""
    files = read_manifest(root)["entries"].get(final.name)
    if files is None:
        return False
    source = root / final.name
    found = {rel: file_digest(source / rel) if (source / rel).is_file() else None for rel in files}
    bad = sorted(rel for rel, digest in found.items() if digest != files[rel])
    if bad:
        raise ShippedEntryError(f"{source}: {', '.join(bad)} missing or not the shipped bytes (reinstall the "
                                "package, or set warmup.use_shipped=false to make the entry here)")
    # Another process may install the same entry meanwhile: same bytes, the first one stays.
    with atomic_files.atomic_dir(final, if_exists="keep") as staging:
        for rel in files:
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / rel, staging / rel)
    logger.info("installed the shipped %s into the cache (%s)", final.name, final)
    return True
