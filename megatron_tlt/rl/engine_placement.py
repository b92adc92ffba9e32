"""Which ranks share one vLLM engine, and which prompts each engine answers.

A rollout engine spans ``engine_tp`` consecutive ranks (vLLM's ``external_launcher`` groups the
world in consecutive blocks of its tensor-parallel size; Megatron's tensor-parallel groups are
consecutive too, so an engine whose size divides the policy's TP lies inside one Megatron TP group
and hence inside one data-parallel replica). The ranks of an engine must submit identical requests
and get identical outputs back; the engines of a replica split its prompts between them.

With engine TP = 1 every rank is its own engine: the behaviour before engines followed the policy.
Which engine sizes are allowed is the layout rule book's (``layout_rules.resolve_engine_tp``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TypeVar

from megatron_tlt.layout_rules import resolve_engine_tp

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class EnginePlacement:
    """This rank's engine: its size, its place among the engines, and its share of the prompts."""

    tensor_parallel_size: int
    """Ranks that hold one engine together (vLLM tensor parallelism)."""
    rank_in_engine: int
    index_in_replica: int
    """Which of its data-parallel replica's engines this is."""
    engines_per_replica: int
    global_index: int
    """Which engine of the whole world this is (``rank // tensor_parallel_size``)."""
    num_engines: int

    @property
    def is_leader(self) -> bool:
        """The engine's first rank: it alone reports the engine's results, so nothing counts twice."""
        return self.rank_in_engine == 0

    @property
    def leader_rank(self) -> int:
        return self.global_index * self.tensor_parallel_size

    def replica_share(self, items: Sequence[T]) -> list[T]:
        """This engine's share of its replica's items (every rank of the engine gets the same share)."""
        return list(items[self.index_in_replica :: self.engines_per_replica])

    def world_share(self, items: Sequence[T]) -> list[T]:
        """This engine's share of items spread over every engine of the world (e.g. held-out prompts)."""
        return list(items[self.global_index :: self.num_engines])

    def leaders_only(self, per_mp_rank: Sequence[T]) -> list[T]:
        """From one item per model-parallel rank (an all-gather), the engines' leaders' items."""
        return list(per_mp_rank[:: self.tensor_parallel_size])


def engine_placement(engine_tensor_parallel_size: int) -> EnginePlacement:
    """This rank's placement (Megatron's groups must exist)."""
    import torch.distributed as dist

    from megatron_tlt.model import mcore

    resolve_engine_tp(engine_tensor_parallel_size, mcore.stage_info().tp_size)  # the groups as built, not as configured
    mp_group = mcore.model_parallel_group()
    return placement_of(rank=dist.get_rank(), world_size=dist.get_world_size(), mp_rank=dist.get_rank(mp_group),
                        mp_size=dist.get_world_size(mp_group), engine_tensor_parallel_size=engine_tensor_parallel_size)


def placement_of(*, rank: int, world_size: int, mp_rank: int, mp_size: int,
                 engine_tensor_parallel_size: int) -> EnginePlacement:
    """The placement of ``rank``, at ``mp_rank`` of its model-parallel group (ranks in global order).

    vLLM groups engines as consecutive global ranks; inside a model-parallel group, whose tensor-
    parallel groups are consecutive and start at multiples of the policy's TP, those are consecutive
    group ranks too, so ``mp_rank // engine_tp`` numbers the replica's engines.
    """
    t = engine_tensor_parallel_size
    return EnginePlacement(tensor_parallel_size=t, rank_in_engine=rank % t, index_in_replica=mp_rank // t,
                           engines_per_replica=mp_size // t, global_index=rank // t, num_engines=world_size // t)
