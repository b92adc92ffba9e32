"""Megatron training on CPU: the same loss curve at world size 1, TP=2, PP=2 and DP=2, and whatever the policy
is built with (attention kind, activation recompute, sequence parallelism, the distributed optimizer)."""

import pytest
import torch

from megatron_tlt.launcher import run_on_ranks

NUM_STEPS = 5


def _fixed_microbatches():
    from megatron_tlt.model.lm_training import LMMicroBatch

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 250, (4, 17), generator=g)
    mask = torch.ones_like(tokens)
    mask[:, :4] = 0  # a prompt whose tokens carry no loss
    return [LMMicroBatch(tokens[i : i + 2], mask[i : i + 2]) for i in (0, 2)]


def _train_on_rank(ckpt_dir: str, tp: int, pp: int, build: dict | None = None, distributed_optimizer: bool = False):
    from megatron_tlt.model import mcore, policy
    from megatron_tlt.model.build_options import BuildOptions
    from megatron_tlt.model.lm_training import lm_train_step
    from megatron_tlt.parallel import ParallelLayout

    with ParallelLayout(tensor_parallel_size=tp, pipeline_parallel_size=pp) as layout:
        model, meta = policy.load_policy_checkpoint(ckpt_dir, options=BuildOptions(**(build or {})))
        model = mcore.wrap_ddp(model, distributed_optimizer=distributed_optimizer)
        optimizer = mcore.build_optimizer(model, lr=3e-3)
        microbatches = _fixed_microbatches()
        if layout.data_parallel_size > 1:  # each replica takes its share of the global batch
            microbatches = microbatches[layout.rank :: layout.data_parallel_size]
        return [lm_train_step(model, optimizer, microbatches, vocab_size=meta.arch.vocab_size)
                for _ in range(NUM_STEPS)]


@pytest.fixture(scope="module")
def world1_losses(llama_mcore_tp2):
    return run_on_ranks(_train_on_rank, 1, str(llama_mcore_tp2), 1, 1)[0]


def test_training_reduces_the_loss_at_world_size_1(world1_losses):
    assert world1_losses[-1] < world1_losses[0] - 0.1


@pytest.mark.parametrize("tp, pp, world", [(2, 1, 2), (1, 2, 2), (1, 1, 2)], ids=["tp2", "pp2", "dp2"])
def test_loss_curve_matches_world_size_1(tp, pp, world, llama_mcore_tp2, world1_losses):
    per_rank = run_on_ranks(_train_on_rank, world, str(llama_mcore_tp2), tp, pp)
    curves = [c for c in per_rank.values() if c[0] is not None]
    if tp * pp == 1:  # data parallel: each replica reports its own micro-batch; the step is their mean
        curves = [[sum(losses) / len(losses) for losses in zip(*curves)]]
    assert curves
    for curve in curves:
        assert curve == pytest.approx(world1_losses, abs=1e-5)


@pytest.mark.parametrize("build", [dict(attention="local"), dict(recompute="full"),
                                   dict(attention="local", recompute="selective")],
                         ids=["local-attention", "full-recompute", "local-selective-recompute"])
def test_how_the_policy_is_built_does_not_change_its_loss_curve(build, llama_mcore_tp2, world1_losses):
    # The default is SDPA attention without recompute; the other kernels and recompute compute the same function.
    curve = run_on_ranks(_train_on_rank, 1, str(llama_mcore_tp2), 1, 1, build)[0]
    assert curve == pytest.approx(world1_losses, abs=1e-5)


def test_sequence_parallelism_and_the_distributed_optimizer_keep_the_loss_curve(llama_mcore_tp2, world1_losses):
    # TP=2 with the sequence split over the two ranks (norm-weight grads all-reduced over TP) ...
    sp = run_on_ranks(_train_on_rank, 2, str(llama_mcore_tp2), 2, 1, dict(sequence_parallel=True))
    for curve in sp.values():
        assert curve == pytest.approx(world1_losses, abs=1e-5)
    # ... and DP=2 with Adam's state sharded over the replicas (reduce-scatter, all-gather on gloo).
    dp = run_on_ranks(_train_on_rank, 2, str(llama_mcore_tp2), 1, 1, None, True)
    mean = [sum(losses) / len(losses) for losses in zip(*dp.values())]
    assert mean == pytest.approx(world1_losses, abs=1e-5)


def _distributed_optimizer_round_trip_on_rank(ckpt_dir: str, state_dir: str):
    """Two steps; the optimizer state saved after the first, loaded into a fresh optimizer over the first step's
    weights, must reproduce the second step exactly."""
    from megatron_tlt.model import mcore, policy
    from megatron_tlt.model.lm_training import lm_train_step
    from megatron_tlt.parallel import ParallelLayout

    with ParallelLayout() as layout:
        microbatches = _fixed_microbatches()[layout.rank :: layout.data_parallel_size]

        def build():
            model, meta = policy.load_policy_checkpoint(ckpt_dir)
            ddp = mcore.wrap_ddp(model, distributed_optimizer=True)
            return model, ddp, mcore.build_optimizer(ddp, lr=3e-3), meta.arch.vocab_size

        model, ddp, optimizer, vocab = build()
        lm_train_step(ddp, optimizer, microbatches, vocab_size=vocab)
        path = f"{state_dir}/rank{layout.rank}.pt"
        torch.save(mcore.optimizer_state(optimizer), path)
        after_first = [p.detach().clone() for p in model.parameters()]
        lm_train_step(ddp, optimizer, microbatches, vocab_size=vocab)
        expected = [p.detach().clone() for p in model.parameters()]

        model, ddp, optimizer, vocab = build()
        with torch.no_grad():
            for p, w in zip(model.parameters(), after_first):
                p.copy_(w)
        mcore.load_optimizer_state(optimizer, torch.load(path, weights_only=False))
        lm_train_step(ddp, optimizer, microbatches, vocab_size=vocab)
        return mcore.is_distributed_optimizer(optimizer), max(
            (p - e).abs().max().item() for p, e in zip(model.parameters(), expected))


def test_a_distributed_optimizer_restored_from_its_saved_state_takes_the_same_step(llama_mcore_tp2, tmp_path):
    for distributed, max_diff in run_on_ranks(_distributed_optimizer_round_trip_on_rank, 2, str(llama_mcore_tp2),
                                              str(tmp_path)).values():
        assert distributed
        assert max_diff == 0.0


def test_tied_embedding_model_trains_identically_split_over_two_pipeline_stages(qwen2_mcore_tp2):
    # With PP=2 the first stage owns the embedding and the last a copy used as the LM head; their
    # gradients must be summed across the two stages every step or the curves drift apart.
    world1 = run_on_ranks(_train_on_rank, 1, str(qwen2_mcore_tp2), 1, 1)[0]
    pp2 = run_on_ranks(_train_on_rank, 2, str(qwen2_mcore_tp2), 1, 2)[1]
    assert world1[-1] < world1[0] - 0.1
    assert pp2 == pytest.approx(world1, abs=1e-5)


def test_first_step_loss_equals_transformers_cross_entropy_on_the_real_vocabulary(world1_losses, tiny_llama_dir):
    # The vocabulary is padded (250 -> 256 rows); padded logits must not take probability mass.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    losses = []
    with torch.no_grad():
        for mb in _fixed_microbatches():
            logits = model(mb.tokens_bs[:, :-1]).logits
            token_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), mb.tokens_bs[:, 1:], reduction="none")
            mask = mb.loss_mask_bs[:, 1:].float()
            losses.append(((token_loss * mask).sum() / mask.sum()).item())
    assert world1_losses[0] == pytest.approx(sum(losses) / len(losses), abs=1e-5)
