"""Every batch builder puts every tensor on the device it is given (here the meta device, so a builder that
ignores it fails on a CPU machine too), and builds the same values as before on the CPU."""

import dataclasses

import pytest
import torch

from megatron_tlt.device import compute_device, module_device, to_device
from megatron_tlt.model.lm_training import LMMicroBatch, token_width
from megatron_tlt.parallel import ParallelLayout
from megatron_tlt.rl.actor import pad_sequences
from megatron_tlt.rl.tiny.warmup import length_sorted_microbatches
from megatron_tlt.rl.update import PolicyMicroBatch, PolicySequence, make_microbatch, make_microbatches

META = torch.device("meta")
CPU = torch.device("cpu")


def _tensors(batch) -> dict[str, torch.Tensor]:
    return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)
            if isinstance(getattr(batch, f.name), torch.Tensor)}


def _on(batch, device: torch.device) -> bool:
    return all(t.device == device for t in _tensors(batch).values())


def _policy_sequences(with_ref: bool = True) -> list[PolicySequence]:
    def seq(ids, prompt_len, old, advantage):
        old = torch.tensor(old)
        return PolicySequence(token_ids=ids, prompt_len=prompt_len, old_logprobs=old, advantage=advantage,
                              ref_logprobs=old * 10 if with_ref else None)

    return [seq([5, 6, 7, 8], 2, [-0.1, -0.2, -0.3], 1.0), seq([9, 10, 11], 1, [-0.4, -0.5], -0.5)]


WARMUP_PAIRS = [([1, 2, 3], 1), ([4, 5], 1), ([6, 7, 8, 9], 2)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a CPU-only machine resolves to")
def test_this_rank_computes_on_the_cpu_when_there_is_no_cuda():
    assert compute_device() == CPU
    assert ParallelLayout().device == CPU


def test_a_wrapped_model_is_on_the_device_of_its_parameters():
    class Wrapper(torch.nn.Module):  # as DDP / Float16Module hold their module
        def __init__(self, module):
            super().__init__()
            self.module = module

    assert module_device(Wrapper(torch.nn.Linear(2, 2, device=META))) == META


def test_a_policy_microbatch_is_built_on_the_requested_device_with_its_shapes_and_dtypes():
    batch = make_microbatch(_policy_sequences(), pad_id=0, width=6, device=META)
    assert _on(batch, META)
    assert {name: (tuple(t.shape), t.dtype) for name, t in _tensors(batch).items()} == {
        "tokens_bs": ((2, 6), torch.long), "response_mask_bl": ((2, 5), torch.bool),
        "old_logprobs_bl": ((2, 5), torch.float32), "ref_logprobs_bl": ((2, 5), torch.float32),
        "advantages_b": ((2,), torch.float32)}


def test_length_sorted_policy_microbatches_are_all_on_the_requested_device():
    longer = PolicySequence(token_ids=[1, 2, 3, 4, 5], prompt_len=1, old_logprobs=torch.zeros(4), advantage=0.0)
    sequences = _policy_sequences(with_ref=False) + [longer]
    for same_width, widths in ((False, [4, 5]), (True, [5, 5])):
        batches = make_microbatches(sequences, 2, 0, same_width=same_width, device=META)
        assert all(_on(b, META) and b.ref_logprobs_bl is None for b in batches)
        assert [b.tokens_bs.shape[1] for b in batches] == widths


def test_a_policy_microbatch_on_the_cpu_holds_the_padded_tokens_response_mask_and_logprobs():
    batch = make_microbatch(_policy_sequences(), pad_id=0, device=CPU)
    assert batch.tokens_bs.tolist() == [[5, 6, 7, 8], [9, 10, 11, 0]]
    # label t predicts token t + 1: a response label from prompt_len - 1 to len - 2
    assert batch.response_mask_bl.tolist() == [[False, True, True], [True, True, False]]
    torch.testing.assert_close(batch.old_logprobs_bl, torch.tensor([[-0.1, -0.2, -0.3], [-0.4, -0.5, 0.0]]))
    torch.testing.assert_close(batch.ref_logprobs_bl, torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, 0.0]]))
    assert batch.advantages_b.tolist() == [1.0, -0.5]


def test_the_log_prob_pass_pads_its_token_ids_on_the_requested_device():
    assert pad_sequences([[1, 2, 3], [4]], 0, device=META).device == META
    padded = pad_sequences([[1, 2, 3], [4]], 0, device=CPU)
    assert (padded.dtype, padded.tolist()) == (torch.long, [[1, 2, 3], [4, 0, 0]])


def test_warmup_microbatches_are_built_on_the_requested_device():
    batches = length_sorted_microbatches(WARMUP_PAIRS, 2, 0, same_length=True, device=META)
    assert all(_on(b, META) for b in batches)
    assert [(tuple(b.tokens_bs.shape), b.tokens_bs.dtype, b.loss_mask_bs.dtype) for b in batches] == [
        ((2, 4), torch.long, torch.long), ((1, 4), torch.long, torch.long)]


def test_warmup_microbatches_on_the_cpu_are_length_sorted_with_the_loss_after_the_prompt():
    first, second = length_sorted_microbatches(WARMUP_PAIRS, 2, 0, same_length=False, device=CPU)
    assert first.tokens_bs.tolist() == [[4, 5, 0], [1, 2, 3]]
    assert first.loss_mask_bs.tolist() == [[0, 1, 0], [0, 1, 1]]
    assert second.tokens_bs.tolist() == [[6, 7, 8, 9]]
    assert second.loss_mask_bs.tolist() == [[0, 0, 1, 1]]


@pytest.mark.parametrize("batch", [
    LMMicroBatch(tokens_bs=torch.ones(2, 3, dtype=torch.long), loss_mask_bs=torch.ones(2, 3, dtype=torch.long)),
    PolicyMicroBatch(tokens_bs=torch.ones(2, 3, dtype=torch.long), response_mask_bl=torch.ones(2, 2, dtype=torch.bool),
                     old_logprobs_bl=torch.zeros(2, 2), ref_logprobs_bl=None, advantages_b=torch.zeros(2)),
], ids=["lm", "policy"])
def test_moving_a_batch_moves_every_tensor_field_and_keeps_the_rest(batch):
    moved = to_device(batch, META)
    assert type(moved) is type(batch) and _on(moved, META)
    assert {n: (t.shape, t.dtype) for n, t in _tensors(moved).items()} == {
        n: (t.shape, t.dtype) for n, t in _tensors(batch).items()}
    if isinstance(batch, PolicyMicroBatch):
        assert moved.ref_logprobs_bl is None


def test_a_tensor_already_on_the_device_is_not_copied():
    tokens_bs = torch.ones(2, 3)
    assert to_device(tokens_bs, CPU) is tokens_bs


def test_with_sequence_parallelism_token_rows_are_padded_so_the_model_input_splits_over_the_tp_ranks():
    # the model reads width - 1 tokens (the last is a label only): that length is padded to the multiple
    assert [token_width(n, 2) for n in (2, 3, 4, 5, 8)] == [3, 3, 5, 5, 9]
    assert [token_width(n, 4) for n in (2, 5, 6)] == [5, 5, 9]
    assert [token_width(n) for n in (2, 3, 8)] == [2, 3, 8]


def test_every_batch_builder_pads_to_the_input_multiple():
    assert pad_sequences([[1, 2, 3, 4], [5]], 0, device=CPU, input_multiple=2).tolist() == [
        [1, 2, 3, 4, 0], [5, 0, 0, 0, 0]]
    batch = make_microbatch(_policy_sequences(), pad_id=0, device=CPU, input_multiple=2)
    assert batch.tokens_bs.tolist() == [[5, 6, 7, 8, 0], [9, 10, 11, 0, 0]]
    # the extra label position is no response position, and its old/ref log-probs are zero padding
    assert batch.response_mask_bl.tolist() == [[False, True, True, False], [True, True, False, False]]
    assert batch.old_logprobs_bl[:, -1].tolist() == [0.0, 0.0]
    longer = PolicySequence(token_ids=[1, 2, 3, 4, 5, 6], prompt_len=1, old_logprobs=torch.zeros(5), advantage=0.0)
    for same_width, widths in ((False, [5, 7]), (True, [7, 7])):
        batches = make_microbatches(_policy_sequences(with_ref=False) + [longer], 2, 0, same_width=same_width,
                                    device=META, input_multiple=2)
        assert [b.tokens_bs.shape[1] for b in batches] == widths
    first, second = length_sorted_microbatches(WARMUP_PAIRS, 2, 0, same_length=False, device=CPU, input_multiple=2)
    assert first.tokens_bs.tolist() == [[4, 5, 0], [1, 2, 3]]  # width 3 already fits
    assert (second.tokens_bs.tolist(), second.loss_mask_bs.tolist()) == ([[6, 7, 8, 9, 0]], [[0, 0, 1, 1, 0]])
