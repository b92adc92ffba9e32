"""The layout rule book: which tensor / pipeline / engine parallel sizes a model and a run can be split into.

``tlt train`` (``config.load_config`` for the rules that need no model, ``check_run_layout`` for the rest)
and ``tlt plan`` (``plan_checks``) both refuse layouts through these functions, so the two cannot disagree
and a refusal reads the same sentence in both. Each rule raises ``LayoutError`` with one sentence naming
the values and what would pass. The cluster's own rules (TP within a node, TP x PP dividing the GPUs) are
the planner's alone: ``tlt train`` learns the cluster only when torchrun starts it.

Imports nothing of the package: ``formats/architecture.py`` (``PolicyArchitecture.validate_layout``) and
``config`` (``load_config``) use it, so the model is any object with the ``ModelShape`` attributes (a
``PolicyArchitecture``) and the run a ``config.TLTConfig``.
"""

from __future__ import annotations

from typing import Protocol


class ModelShape(Protocol):
    """What the rules read of a model: ``formats.architecture.PolicyArchitecture`` has these attributes."""

    num_attention_heads: int
    num_kv_heads: int
    intermediate_size: int
    num_layers: int


class LayoutError(ValueError):
    """A parallel layout that the model or the engines cannot be split into; one sentence naming the values."""


def _divisors(n: int) -> str:
    """The sizes that would pass, up to 64 (more GPUs than any TP or PP group holds)."""
    return ", ".join(str(d) for d in range(1, min(n, 64) + 1) if n % d == 0)


def _require_divides(size: int, what: str, dimension: str, total: int) -> None:
    """Megatron and vLLM split ``dimension`` evenly over ``size`` ranks: refuse a remainder."""
    if total % size:
        raise LayoutError(f"{what} {size} does not divide {dimension} {total} "
                          f"(sizes that divide it: {_divisors(total)})")


def check_tensor_parallel(arch: ModelShape, *, tp: int) -> None:
    """Megatron's TP splits the attention heads, the KV heads and the MLP's intermediate rows evenly."""
    if tp < 1:
        raise LayoutError(f"tensor parallel size must be >= 1, got {tp}")
    _require_divides(tp, "tensor parallel size", "num_attention_heads", arch.num_attention_heads)
    _require_divides(tp, "tensor parallel size", "num_key_value_heads", arch.num_kv_heads)
    _require_divides(tp, "tensor parallel size", "intermediate_size", arch.intermediate_size)


def check_pipeline_parallel(arch: ModelShape, *, pp: int) -> None:
    """Every pipeline stage holds the same number of layers (at least one)."""
    if pp < 1:
        raise LayoutError(f"pipeline parallel size must be >= 1, got {pp}")
    if pp > arch.num_layers:
        raise LayoutError(f"pipeline parallel size {pp} is larger than num_hidden_layers {arch.num_layers} "
                          "(every stage needs at least one layer)")
    _require_divides(pp, "pipeline parallel size", "num_hidden_layers", arch.num_layers)


def check_policy_layout(arch: ModelShape, *, tp: int, pp: int) -> None:
    """The policy's Megatron layout: TP divides the heads, KV heads and intermediate_size, PP the layers."""
    check_tensor_parallel(arch, tp=tp)
    check_pipeline_parallel(arch, pp=pp)


def check_engine_model(arch: ModelShape, *, engine_tp: int) -> None:
    """vLLM's TP splits the attention heads and the MLP evenly; KV heads it splits, or replicates in whole
    copies when the engine has more ranks than KV heads."""
    if engine_tp < 1:
        raise LayoutError(f"engine tensor parallel size must be >= 1, got {engine_tp}")
    _require_divides(engine_tp, "engine tensor parallel size", "num_attention_heads", arch.num_attention_heads)
    _require_divides(engine_tp, "engine tensor parallel size", "intermediate_size", arch.intermediate_size)
    kv = arch.num_kv_heads
    if kv % engine_tp and engine_tp % kv:
        raise LayoutError(f"engine tensor parallel size {engine_tp} must divide, or be a multiple of, "
                          f"num_key_value_heads {kv} (vLLM splits KV heads or replicates them in whole copies)")


def check_engine_layout(*, engine_tp: int, policy_tp: int, arch: ModelShape | None = None) -> None:
    """An engine's ranks lie inside one tensor-parallel group of the policy (``rl/engine_placement.py``), so
    its size divides the policy's TP; with the model, vLLM's own limits too."""
    if engine_tp < 1 or policy_tp % engine_tp:
        raise LayoutError(
            f"rollout.engine.tensor_parallel_size {engine_tp} must be >= 1 and divide parallel.tensor_parallel_size "
            f"{policy_tp}: an engine's ranks must lie in one tensor-parallel group of the policy "
            f"(sizes that divide it: {_divisors(policy_tp) if policy_tp >= 1 else 'none'})")
    if arch is not None:
        check_engine_model(arch, engine_tp=engine_tp)


def check_sequence_parallel(*, sequence_parallel: bool, tp: int) -> None:
    """Sequence parallelism splits the sequence over the tensor-parallel ranks: with one there is nothing to split."""
    if sequence_parallel and tp < 2:
        raise LayoutError(f"parallel.sequence_parallel needs parallel.tensor_parallel_size > 1, got {tp} (it splits "
                          "the sequence over the tensor-parallel ranks): raise the TP or turn sequence parallelism off")


def resolve_engine_tp(configured: int | None, policy_tp: int) -> int:
    """``rollout.engine.tensor_parallel_size``: None means the policy's TP; refused unless it divides it."""
    engine_tp = policy_tp if configured is None else configured
    check_engine_layout(engine_tp=engine_tp, policy_tp=policy_tp)
    return engine_tp


def check_config_layout(config) -> None:
    """The rules a ``config.TLTConfig`` breaks whatever the model: sequence parallelism and the engine's TP."""
    p = config.parallel
    check_sequence_parallel(sequence_parallel=p.sequence_parallel, tp=p.tensor_parallel_size)
    resolve_engine_tp(config.rollout.engine.tensor_parallel_size, p.tensor_parallel_size)


def check_run_layout(config, arch: ModelShape) -> None:
    """Every layout rule ``tlt train`` needs for a ``config.TLTConfig`` and the model it trains (before any
    rank starts)."""
    p = config.parallel
    check_config_layout(config)
    check_policy_layout(arch, tp=p.tensor_parallel_size, pp=p.pipeline_parallel_size)
    engine_tp = resolve_engine_tp(config.rollout.engine.tensor_parallel_size, p.tensor_parallel_size)
    check_engine_layout(engine_tp=engine_tp, policy_tp=p.tensor_parallel_size, arch=arch)
