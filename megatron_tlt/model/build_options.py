"""How the policy is built, as opposed to what it is: attention kernel, activation recompute, sequence
parallelism. A light module (no torch): the config validates against it, ``model/mcore.py`` builds from it and
``tlt plan`` estimates memory from the same options.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

Attention = Literal["sdpa", "local", "te"]
Recompute = Literal["none", "selective", "full"]
ATTENTIONS, RECOMPUTES = get_args(Attention), get_args(Recompute)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuildOptions:
    """How the policy is built, as opposed to what it is: none of these changes its weights or their names.

    ``tlt plan`` estimates memory from the same options (``plan.PlanOptions``); ``config.build_options``
    makes them from ``model.attention``, ``trainer.recompute`` and ``parallel.sequence_parallel``.
    """

    attention: str = "sdpa"
    """sdpa: ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels; activations linear in the
    sequence); local: Megatron's ``DotProductAttention`` (keeps the [s, s] softmax and probabilities);
    te: Transformer Engine's fused attention (GPU with TE only)."""
    recompute: str = "none"
    """Activation recompute: none; selective (the core attention, Megatron's ``recompute_modules=[core_attn]``;
    only worth it with ``attention=local``); full (each layer keeps its input only and is recomputed)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (TP > 1): norms and residuals hold s / TP tokens per rank."""

    def __post_init__(self):
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got '{self.attention}'")
        if self.recompute not in RECOMPUTES:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTES)}, got '{self.recompute}'")
