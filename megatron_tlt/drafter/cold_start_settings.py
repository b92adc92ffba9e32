"""The knobs of ``tlt warmup-drafter`` (``drafter/cold_start.py`` runs it): importable without torch,
Megatron or vLLM, so the CLI checks them before any rank starts."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class ColdStartSettings:
    prompts: int = 1024
    """Training prompts (one response each), over all data-parallel ranks."""
    eval_prompts: int = 128
    epochs: int = 3
    draft_tokens: int = 2
    """Draft depth of the acceptance measurement."""
