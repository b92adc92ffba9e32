"""Which TP x PP layouts of a model can run on a cluster, refused as Megatron-Core, vLLM and ``tlt train``
would refuse them (``model_config.PolicyArchitecture.validate_layout``'s words for the model's own limits)."""

from __future__ import annotations

from megatron_tlt.model_config import ModelConfigError, PolicyArchitecture
from megatron_tlt.plan_model import PlanError

def check_tensor_parallel(arch: PolicyArchitecture, *, tp: int, gpus_per_node: int) -> None:
    """TP must divide the heads, the KV heads and the MLP, and stay within one node."""
    if tp < 1:
        raise PlanError(f"TP={tp} refused: parallel sizes must be >= 1")
    try:
        arch.validate_layout(tensor_parallel_size=tp, pipeline_parallel_size=1)
    except ModelConfigError as err:
        raise PlanError(f"TP={tp} refused: {err}") from None
    if arch.intermediate_size % tp:
        raise PlanError(f"TP={tp} refused: tensor parallel size {tp} does not divide intermediate_size "
                        f"{arch.intermediate_size}")
    if tp > gpus_per_node:
        raise PlanError(f"TP={tp} refused: tensor parallelism must stay within one node, which has "
                        f"{gpus_per_node} GPUs")
    if gpus_per_node % tp:
        raise PlanError(f"TP={tp} refused: it does not divide the {gpus_per_node} GPUs of a node, so a TP group "
                        f"would span two nodes")


def check_pipeline_parallel(arch: PolicyArchitecture, *, pp: int) -> None:
    """PP must divide the layers."""
    if pp < 1:
        raise PlanError(f"PP={pp} refused: parallel sizes must be >= 1")
    try:
        arch.validate_layout(tensor_parallel_size=1, pipeline_parallel_size=pp)
    except ModelConfigError as err:
        raise PlanError(f"PP={pp} refused: {err}") from None


def check_engine_tp(arch: PolicyArchitecture, *, engine_tp: int, gpus_per_node: int) -> None:
    """vLLM's TP must divide the attention heads (KV heads are replicated when it exceeds them) and a node."""
    e = engine_tp
    if e < 1 or gpus_per_node % e:
        raise PlanError(f"engine TP={e} refused: it must divide the {gpus_per_node} GPUs of a node")
    if arch.num_attention_heads % e:
        raise PlanError(f"engine TP={e} refused: it does not divide num_attention_heads {arch.num_attention_heads}")
    if arch.num_kv_heads % e and e % arch.num_kv_heads:
        raise PlanError(f"engine TP={e} refused: vLLM needs it to divide, or be a multiple of, "
                        f"num_key_value_heads {arch.num_kv_heads}")


def check_layout(arch: PolicyArchitecture, *, nodes: int, gpus_per_node: int, tp: int, pp: int,
                 engine_tp: int | None = None) -> int:
    """Refuse a layout that cannot run (``PlanError``, one sentence); return the data-parallel size.

    The model's own limits come first (``PolicyArchitecture.validate_layout``: TP divides the attention and
    KV heads, PP the layers), then the cluster's (TP within a node, TP x PP dividing the GPUs)."""
    if nodes < 1 or gpus_per_node < 1:
        raise PlanError(f"nodes and GPUs per node must be >= 1, got {nodes} x {gpus_per_node}")
    check_tensor_parallel(arch, tp=tp, gpus_per_node=gpus_per_node)
    check_pipeline_parallel(arch, pp=pp)
    world = nodes * gpus_per_node
    if world % (tp * pp):
        raise PlanError(f"TP={tp} PP={pp} refused: TP x PP = {tp * pp} does not divide the {world} GPUs "
                        f"({cluster_name(nodes, gpus_per_node)})")
    if engine_tp is not None:
        check_engine_tp(arch, engine_tp=engine_tp, gpus_per_node=gpus_per_node)
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


