"""Megatron-Core on one GPU, a world of 1 (TP=1, PP=1) in this process: fp32 logits equal transformers',
a bf16 update lowers the loss, and the RL log-prob pass equals transformers' log-probs and features."""

import pytest
import torch

from megatron_tlt.launcher import run_on_ranks
from tiny_models import hf_logprobs_and_features
from logit_parity import PARITY_TOLERANCE, megatron_vs_hf_max_abs_diff

pytestmark = pytest.mark.needs("cuda", "megatron")

SEQUENCES = [[1, 5, 7, 9, 11, 13], [3, 4, 100], [200, 13, 17, 19, 23, 29, 31, 37], [42, 43]]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_megatron_logits_on_cuda_match_transformers_at_fp32(family, request, sample_input_ids):
    ckpt_dir, hf_dir = request.getfixturevalue(f"{family}_mcore_tp1"), request.getfixturevalue(f"tiny_{family}_dir")
    diff = megatron_vs_hf_max_abs_diff(ckpt_dir, hf_dir, tp=1, pp=1, input_ids_bs=sample_input_ids)
    assert diff < PARITY_TOLERANCE  # 8e-7 measured on an H100


def _bf16_training_on_rank(ckpt_dir: str, num_steps: int):
    from megatron_tlt.model import mcore, policy
    from megatron_tlt.model.lm_training import LMMicroBatch, lm_train_step
    from megatron_tlt.parallel import ParallelLayout

    with ParallelLayout():
        model, meta = policy.load_policy_checkpoint(ckpt_dir)
        matrix_dtypes = {p.dtype for p in model.parameters() if p.dim() > 1}
        model = mcore.wrap_ddp(model)
        optimizer = mcore.build_optimizer(model, lr=3e-3)
        tokens = torch.randint(0, meta.arch.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(tokens)
        mask[:, :4] = 0  # a prompt whose tokens carry no loss
        microbatches = [LMMicroBatch(tokens[i : i + 2], mask[i : i + 2]) for i in (0, 2)]  # on the host
        losses = [lm_train_step(model, optimizer, microbatches, vocab_size=meta.arch.vocab_size)
                  for _ in range(num_steps)]
        optimizers = [type(o).__name__ for o in getattr(optimizer, "chained_optimizers", [optimizer])]
        return matrix_dtypes, optimizers, losses


def test_bf16_policy_update_on_cuda_lowers_the_loss(llama_mcore_bf16):
    matrix_dtypes, optimizers, losses = run_on_ranks(_bf16_training_on_rank, 1, str(llama_mcore_bf16), 5)[0]
    assert matrix_dtypes == {torch.bfloat16}
    assert optimizers == ["Float16OptimizerWithFloat16Params"]  # Megatron's: fp32 master weights
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.1, losses


def _logprobs_on_rank(ckpt_dir: str):
    from megatron_tlt.model import policy
    from megatron_tlt.parallel import ParallelLayout
    from megatron_tlt.rl.actor import compute_logprobs

    with ParallelLayout():
        model, meta = policy.load_policy_checkpoint(ckpt_dir)
        result = compute_logprobs(model, SEQUENCES, vocab_size=meta.arch.vocab_size, micro_batch_size=3,
                                  capture_hidden=True)
        logprobs, hidden = [lp.cpu() for lp in result.token_logprobs], [h.cpu() for h in result.hidden_states]
        return logprobs, hidden, result.features.device.type


def test_rl_logprob_pass_on_cuda_matches_transformers_logprobs_and_drafter_features(llama_mcore_tp1, tiny_llama_dir):
    logprobs, hidden, device = run_on_ranks(_logprobs_on_rank, 1, str(llama_mcore_tp1))[0]
    ref_logprobs, ref_hidden = hf_logprobs_and_features(tiny_llama_dir, SEQUENCES)
    assert device == "cuda"
    for ours, ref in zip(logprobs + hidden, ref_logprobs + ref_hidden, strict=True):
        assert ours.shape == ref.shape and (ours - ref).abs().max() < PARITY_TOLERANCE  # 9.5e-7 measured
