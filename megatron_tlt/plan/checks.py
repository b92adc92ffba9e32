"""Which TP x PP layouts of a model can run on a cluster. The model's and the engines' rules are the rule
book's (``layout_rules``, which ``tlt train`` refuses with too), so a refusal here carries its sentence;
the cluster's rules (TP within a node, TP x PP dividing the GPUs, an engine within a node) are the
planner's own: ``tlt train`` meets the cluster only when torchrun starts it."""

from __future__ import annotations

from megatron_tlt import layout_rules
from megatron_tlt.formats.architecture import PolicyArchitecture
from megatron_tlt.plan.model import PlanError


def _refuse(prefix: str, rule, **kwargs) -> None:
    """Run one rule of the book; its ``LayoutError`` becomes a ``PlanError`` naming the planned size."""
    try:
        rule(**kwargs)
    except layout_rules.LayoutError as err:
        raise PlanError(f"{prefix} refused: {err}") from None


def check_tensor_parallel(arch: PolicyArchitecture, *, tp: int, gpus_per_node: int) -> None:
    """TP must divide the heads, the KV heads and the MLP (the rule book), and stay within one node."""
    _refuse(f"TP={tp}", layout_rules.check_tensor_parallel, arch=arch, tp=tp)
    if tp > gpus_per_node:
        raise PlanError(f"TP={tp} refused: tensor parallelism must stay within one node, which has "
                        f"{gpus_per_node} GPUs")
    if gpus_per_node % tp:
        raise PlanError(f"TP={tp} refused: it does not divide the {gpus_per_node} GPUs of a node, so a TP group "
                        f"would span two nodes")


def check_pipeline_parallel(arch: PolicyArchitecture, *, pp: int) -> None:
    """PP must divide the layers (the rule book)."""
    _refuse(f"PP={pp}", layout_rules.check_pipeline_parallel, arch=arch, pp=pp)


def check_engine_tp(arch: PolicyArchitecture, *, engine_tp: int, gpus_per_node: int,
                    policy_tp: int | None = None) -> None:
    """vLLM's TP must divide a node, and (the rule book) the policy's TP where it is known, the attention
    heads and the MLP, and divide or be a multiple of the KV heads."""
    e = engine_tp
    if e < 1 or gpus_per_node % e:
        raise PlanError(f"engine TP={e} refused: it must divide the {gpus_per_node} GPUs of a node")
    if policy_tp is None:
        _refuse(f"engine TP={e}", layout_rules.check_engine_model, arch=arch, engine_tp=e)
    else:
        _refuse(f"engine TP={e}", layout_rules.check_engine_layout, engine_tp=e, policy_tp=policy_tp, arch=arch)


def check_layout(arch: PolicyArchitecture, *, nodes: int, gpus_per_node: int, tp: int, pp: int,
                 engine_tp: int | None = None) -> int:
    """Refuse a layout that cannot run (``PlanError``, one sentence); return the data-parallel size.

    The model's own limits come first (``layout_rules.check_policy_layout``: TP divides the attention and KV
    heads and the MLP, PP the layers), then the cluster's (TP within a node, TP x PP dividing the GPUs),
    then the engine's (``layout_rules.check_engine_layout``: it divides the policy's TP)."""
    if nodes < 1 or gpus_per_node < 1:
        raise PlanError(f"nodes and GPUs per node must be >= 1, got {nodes} x {gpus_per_node}")
    check_tensor_parallel(arch, tp=tp, gpus_per_node=gpus_per_node)
    check_pipeline_parallel(arch, pp=pp)
    world = nodes * gpus_per_node
    if world % (tp * pp):
        raise PlanError(f"TP={tp} PP={pp} refused: TP x PP = {tp * pp} does not divide the {world} GPUs "
                        f"({cluster_name(nodes, gpus_per_node)})")
    if engine_tp is not None:
        check_engine_tp(arch, engine_tp=engine_tp, gpus_per_node=gpus_per_node, policy_tp=tp)
    return world // (tp * pp)


def cluster_name(nodes: int, gpus_per_node: int) -> str:
    return f"{nodes} node{'s' if nodes != 1 else ''} x {gpus_per_node} GPUs"


def valid_layouts(arch: PolicyArchitecture, *, nodes: int, gpus_per_node: int, tp: int | None = None,
                  pp: int | None = None, engine_tp: int | None = None) -> list[tuple[int, int]]:
    """Every (TP, PP) that passes ``check_layout``, optionally with one of the two fixed."""
    world = nodes * gpus_per_node
    tps = [tp] if tp else [t for t in range(1, gpus_per_node + 1) if gpus_per_node % t == 0]
    pps = [pp] if pp else [p for p in range(1, arch.num_layers + 1) if world % p == 0]
    out = []
    for t in tps:
        for p in pps:
            try:
                check_layout(arch, nodes=nodes, gpus_per_node=gpus_per_node, tp=t, pp=p, engine_tp=engine_tp or t)
            except PlanError:
                continue
            out.append((t, p))
    return out
