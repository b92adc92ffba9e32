"""The knobs of ``tlt warmup-drafter`` (its flags): importable without torch, Megatron or vLLM, so the CLI
checks them before any rank starts (``warmup_drafter.py`` runs the warm-up on each rank)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class ColdStartSettings:
    """The knobs of ``tlt warmup-drafter`` (its flags; ``warmup_drafter.py`` runs it)."""

    prompts: int = 1024
    """Training prompts (one response each), over all data-parallel ranks."""
    eval_prompts: int = 128
    epochs: int = 3
    draft_tokens: int = 2
    """Draft depth of the acceptance measurement."""
