"""How each rank's rollout engine is built (``rollout.engine.*``): the config tree holds it, so it is
importable without torch or vLLM; the engine itself is ``spec/engine.py``'s."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(kw_only=True)
class RolloutEngineConfig:
    """How each rank's vLLM engine is built."""

    max_model_len: int | None = None
    """Longest prompt + response, in tokens (default: the model's positions, at most 4096)."""
    dtype: str = "float32"
    """Weights and activations in the engine (match the policy's for exact greedy agreement)."""
    kv_cache_gib: float = 1.0
    """KV-cache size on CPU (VLLM_CPU_KVCACHE_SPACE); on GPU see gpu_memory_utilization."""
    gpu_memory_utilization: float = 0.4
    """Share of GPU memory the colocated engine may take; the rest stays for Megatron."""
    enforce_eager: bool = True
    """Skip graph compilation (CPU start-up ~11 s instead of ~29 s)."""
    seed: int = 0
    """Engine seed; per-request seeds make sampling reproducible regardless."""
    max_num_seqs: int = 256
    """Most sequences decoded together."""
    tensor_parallel_size: int | None = None
    """Ranks that share one engine (vLLM tensor parallelism over consecutive ranks); None: the policy's
    tensor_parallel_size. Must divide it. 1 gives every rank a whole engine of its own."""
