"""Megatron training on CPU: the same loss curve at world size 1, TP=2, PP=2 and DP=2."""

import pytest
import torch

from megatron_tlt.launcher import run_on_ranks

NUM_STEPS = 5


def _fixed_microbatches():
    from megatron_tlt.lm_training import LMMicroBatch

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 250, (4, 17), generator=g)
    mask = torch.ones_like(tokens)
    mask[:, :4] = 0  # a prompt whose tokens carry no loss
    return [LMMicroBatch(tokens[i : i + 2], mask[i : i + 2]) for i in (0, 2)]


def _train_on_rank(ckpt_dir: str, tp: int, pp: int):
    from megatron_tlt import mcore, policy
    from megatron_tlt.lm_training import lm_train_step
    from megatron_tlt.parallel import ParallelLayout

    with ParallelLayout(tensor_parallel_size=tp, pipeline_parallel_size=pp) as layout:
        model, meta = policy.load_policy_checkpoint(ckpt_dir)
        model = mcore.wrap_ddp(model)
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
