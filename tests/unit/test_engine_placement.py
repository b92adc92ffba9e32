"""Which ranks share an engine and which prompts each engine answers (rl/engine_placement.py)."""

import pytest

from megatron_tlt.config import ConfigError, load_config
from megatron_tlt.layout_rules import LayoutError, resolve_engine_tp
from megatron_tlt.rl.engine_placement import placement_of


def _megatron_model_parallel_groups(tp: int, pp: int, dp: int) -> list[list[int]]:
    """Megatron's model-parallel groups for its default order (tp fastest, then dp, then pp)."""
    world = tp * pp * dp
    return [sorted(r for r in range(world) if (r // tp) % dp == d) for d in range(dp)]


@pytest.mark.parametrize("tp, pp, dp, engine_tp", [(2, 2, 2, 2), (2, 2, 2, 1), (4, 1, 2, 2), (8, 2, 4, 8), (1, 2, 2, 1)])
def test_every_prompt_is_answered_once_per_replica_by_one_engine_whose_ranks_agree(tp, pp, dp, engine_tp):
    world = tp * pp * dp
    prompts = list(range(24))
    for group in _megatron_model_parallel_groups(tp, pp, dp):
        placements = {rank: placement_of(rank=rank, world_size=world, mp_rank=group.index(rank), mp_size=len(group),
                                         engine_tensor_parallel_size=engine_tp) for rank in group}
        engines: dict[int, list[int]] = {}
        for rank, p in placements.items():
            engines.setdefault(p.global_index, []).append(rank)
            assert p.leader_rank == p.global_index * engine_tp and rank - p.rank_in_engine == p.leader_rank
        for members in engines.values():
            # vLLM's grouping: consecutive global ranks, all in this replica, asking the same prompts
            assert members == list(range(members[0], members[0] + engine_tp))
            assert len({tuple(placements[r].replica_share(prompts)) for r in members}) == 1
        answered = sorted(x for members in engines.values() for x in placements[members[0]].replica_share(prompts))
        assert answered == prompts
        # results gathered over the model-parallel group (in its rank order) keep the leaders' parts only
        leaders = placements[group[0]].leaders_only(group)
        assert leaders == [r for r in group if placements[r].is_leader]
        assert len(leaders) == len(group) // engine_tp


def test_held_out_prompts_are_split_over_every_engine_of_the_world():
    world, engine_tp = 8, 2
    placements = [placement_of(rank=r, world_size=world, mp_rank=r % 4, mp_size=4, engine_tensor_parallel_size=engine_tp)
                  for r in range(world)]
    items = list(range(10))
    shares = {p.global_index: tuple(p.world_share(items)) for p in placements}
    assert sorted(x for share in shares.values() for x in share) == items and len(shares) == 4


def test_engine_size_defaults_to_the_policy_tp_and_must_divide_it():
    assert resolve_engine_tp(None, 8) == 8
    assert resolve_engine_tp(2, 8) == 2
    for bad in (0, 3, 16):
        with pytest.raises(LayoutError, match="must be >= 1 and divide parallel.tensor_parallel_size 8"):
            resolve_engine_tp(bad, 8)
    with pytest.raises(ConfigError, match="rollout.engine.tensor_parallel_size 4 must be >= 1 and divide"):
        load_config("tiny", ["parallel.tensor_parallel_size=2", "rollout.engine.tensor_parallel_size=4"])
