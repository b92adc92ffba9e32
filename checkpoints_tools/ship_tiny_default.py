"""Remake the tiny default's shipped starting point (``megatron_tlt/rl/tiny/shipped_start.py``).

    python -m checkpoints_tools.ship_tiny_default [key=value ...]

Makes (or takes from the cache) the config's warmed-up policy and its cold-start drafter, the same way
``tlt train`` does with ``warmup.use_shipped=false``, then replaces the shipped copies with them and
writes their manifest. Run it after a change to anything their cache keys hold (the default's shape,
the warm-up or cold-start recipe), and commit the result: the unit tests check that the default's keys
are the shipped ones.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys

from megatron_tlt import atomic_files
from megatron_tlt.commands.start import cold_start_drafter
from megatron_tlt.config import load_config
from megatron_tlt.rl.run.artifact_cache import cache_root
from megatron_tlt.rl.tiny import shipped_start, tiny_default

CONFIG = "tiny"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (default: none)")
    args = parser.parse_args(argv)
    overrides = [*args.overrides, "warmup.use_shipped=false"]
    drafter = cold_start_drafter(CONFIG, overrides)  # its ranks make the policy's warm-up first when missing
    config = load_config(CONFIG, overrides)
    from megatron_tlt.rl.tiny.tiny_source import warmed_up_dir

    tokenizer = tiny_default.load_task_tokenizer(cache_root(config.warmup.cache_dir))
    policy = warmed_up_dir(config, tokenizer)
    root = shipped_start.SHIPPED_DIR
    for old in shipped_start.read_manifest(root)["entries"]:
        atomic_files.remove(root / old)
    entries = {}
    for entry in (policy, drafter):
        shutil.copytree(entry, root / entry.name)
        entries[entry.name] = shipped_start.entry_files(root / entry.name)
    manifest = dict(made_by=f"python -m checkpoints_tools.ship_tiny_default {' '.join(args.overrides)}".strip(),
                    entries=entries)
    atomic_files.write_text_atomic(root / shipped_start.MANIFEST, json.dumps(manifest, indent=1) + "\n")
    size = sum((root / name / rel).stat().st_size for name, files in entries.items() for rel in files)
    print(f"shipped {', '.join(entries)} ({size / 2**20:.1f} MiB) in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
