"""The cache of made artifacts (the tiny default's tokenizer and warmed-up policy, cold-start drafters):
where it lives, and the keys its entries are named by."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from megatron_tlt.config import TLTConfig

CACHE_ENV = "TLT_CACHE_DIR"
CACHE_FORMAT = 2  # bump when a cached artifact's meaning changes


def cache_root(configured: str | None = None) -> Path:
    """Where made artifacts are kept: the configured directory, $TLT_CACHE_DIR, or ~/.cache/megatron-tlt."""
    root = configured or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "megatron-tlt"
    return Path(root).expanduser()


def cache_key(**parts) -> str:
    """A short stable hash of everything that determines an artifact."""
    blob = json.dumps(dict(parts, format=CACHE_FORMAT), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def warmup_recipe(config: TLTConfig) -> dict:
    """The warm-up settings that shape the warmed-up policy (not where it is cached or how RL uses it).
    Part of the warmed-up policy's key and of every cold-start drafter's, whichever the task source."""
    recipe = {k: v for k, v in dataclasses.asdict(config.warmup).items()
              if k not in ("cache_dir", "continue_optimizer", "use_shipped")}
    if recipe["check_share"]:
        recipe["max_response_tokens"] = config.rollout.max_response_tokens  # it bounds the checks
    else:  # a recipe without checks keeps the key it had before they existed
        del recipe["check_share"]
    return recipe
