"""The end-of-rollout average of the drafter replicas on real gloo ranks: the parameters become the token-weighted
mean of the ranks that trained, a rank that never trained takes them whole, and each rank keeps its own Adam
moments."""

import pytest
import torch

from megatron_tlt.launcher import run_on_ranks

LENGTHS = (20, 9, 14)


def _trainer(data_seed: int):
    from megatron_tlt.config import DrafterConfig
    from megatron_tlt.drafter.trainer import DrafterTrainer
    from megatron_tlt.formats.architecture import architecture_from_dict
    from tiny_models import TINY_LLAMA

    arch = architecture_from_dict(TINY_LLAMA)
    settings = DrafterConfig(lr=1e-3, buffer_tokens=256, pack_tokens=128)
    trainer = DrafterTrainer(arch, settings, seed=0)
    heads = torch.Generator().manual_seed(3)  # the policy's heads: the same on every rank
    trainer.set_policy_heads({"model.embed_tokens.weight": torch.randn(arch.vocab_size, arch.hidden_size,
                                                                         generator=heads)})
    g = torch.Generator().manual_seed(data_seed)  # each rank's own rollouts
    token_ids = [torch.randint(0, arch.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
    trainer.add_sequences(token_ids, [torch.randn(n - 1, arch.hidden_size, generator=g) for n in LENGTHS])
    return trainer


def _state(trainer) -> dict:
    params = list(trainer.drafter.parameters())
    states = [trainer.optimizer.state[p] for p in params]
    return {"params": [p.detach().clone() for p in params],
            "exp_avg": [s["exp_avg"].clone() if s else None for s in states],
            "exp_avg_sq": [s["exp_avg_sq"].clone() if s else None for s in states],
            "step": [float(s["step"]) if s else None for s in states]}


SCENARIOS = {"both": [2, 1], "one": [1, 0]}
"""Rank r trains ``micro_steps[r]`` micro-steps, then the replicas are averaged."""


def _scenario(micro_steps: list[int]) -> dict:
    import torch.distributed as dist

    trainer = _trainer(data_seed=10 + dist.get_rank())
    trainer.reset_phase_stats()
    for _ in range(micro_steps[dist.get_rank()]):
        trainer.micro_step()
    before = _state(trainer)
    total = trainer.average_replicas()
    return {"before": before, "after": _state(trainer), "tokens": trainer.tokens_trained, "total": total}


def _scenarios_on_ranks() -> dict:
    """Every scenario in one process group (a spawn of two ranks costs seconds)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        return {name: _scenario(steps) for name, steps in SCENARIOS.items()}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def averaged():
    per_rank = run_on_ranks(_scenarios_on_ranks, 2)
    return {name: {r: per_rank[r][name] for r in (0, 1)} for name in SCENARIOS}


def _weighted(values, weights):
    return sum(v * w for v, w in zip(values, weights)) / sum(weights)


def test_parameters_become_the_token_weighted_mean_and_each_rank_keeps_its_moments(averaged):
    ranks = averaged["both"]
    weights = [ranks[r]["tokens"] for r in (0, 1)]
    assert all(weights) and ranks[0]["total"] == sum(weights)
    for i in range(len(ranks[0]["before"]["params"])):
        expected = _weighted([ranks[r]["before"]["params"][i] for r in (0, 1)], weights)
        for r in (0, 1):
            torch.testing.assert_close(ranks[r]["after"]["params"][i], expected)
    for r in (0, 1):  # the moments and step counts are the rank's own
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                       for a, b in zip(ranks[r]["before"][key], ranks[r]["after"][key]))
    assert ranks[0]["after"]["step"][0] == 2.0 and ranks[1]["after"]["step"][0] == 1.0


def test_a_rank_that_never_trained_takes_the_trained_ranks_parameters_whole(averaged):
    ranks = averaged["one"]
    for a, b in zip(ranks[0]["after"]["params"], ranks[1]["after"]["params"]):
        torch.testing.assert_close(a, b)
    for a, b in zip(ranks[0]["before"]["params"], ranks[0]["after"]["params"]):
        torch.testing.assert_close(a, b)
    assert ranks[1]["after"]["exp_avg"][0] is None and ranks[0]["after"]["exp_avg"][0] is not None
