import pytest
import torch

from megatron_tlt.drafter.buffer import HiddenStateBuffer
from megatron_tlt.drafter.packing import pack_sequences


def _sequence(num_features: int, tag: float):
    """num_features + 1 tokens and their num_features feature rows, every value = tag."""
    return torch.full((num_features + 1,), int(tag)), torch.full((num_features, 4), tag)


def _tags(buffer):
    return [s.features_th[0, 0].item() for s in buffer.sequences()]


def test_buffer_evicts_the_oldest_whole_sequences_first_within_its_token_budget():
    buffer = HiddenStateBuffer(max_tokens=10)
    assert buffer.add(*_sequence(4, 1)) == 0
    assert buffer.add(*_sequence(3, 2)) == 0
    assert buffer.add(*_sequence(3, 3)) == 0 and buffer.num_tokens == 10
    assert buffer.add(*_sequence(5, 4)) == 7  # needs 5: evicts 1 (4 rows), still short, evicts 2 (3 rows)
    assert _tags(buffer) == [3, 4] and buffer.num_tokens == 8
    assert buffer.add(*_sequence(2, 5)) == 0
    assert _tags(buffer) == [3, 4, 5]
    assert (buffer.num_tokens_added, buffer.num_tokens_evicted) == (17, 7)
    assert (buffer.num_sequences_added, buffer.num_sequences_evicted) == (5, 2)
    assert buffer.num_tokens == buffer.num_tokens_added - buffer.num_tokens_evicted


def test_a_sequence_larger_than_the_whole_budget_is_rejected_and_counted():
    buffer = HiddenStateBuffer(max_tokens=10)
    buffer.add(*_sequence(4, 1))
    assert buffer.add(*_sequence(11, 2)) == 0
    assert _tags(buffer) == [1]
    assert (buffer.num_tokens_rejected, buffer.num_sequences_rejected) == (11, 1)


def test_buffer_stores_its_own_copies_and_snapshots_do_not_change():
    buffer = HiddenStateBuffer(max_tokens=100)
    captured = torch.zeros(3, 9, 4)  # like a micro-batch of captured hidden states
    buffer.add(torch.arange(10), captured[1])
    snapshot = buffer.sequences()
    captured.fill_(5.0)
    buffer.add(*_sequence(2, 7))
    assert len(snapshot) == 1 and snapshot[0].features_th.abs().max() == 0
    assert snapshot[0].features_th.untyped_storage().nbytes() == 9 * 4 * 4
    assert len(buffer) == 2


def test_mismatched_tokens_and_features_are_refused():
    with pytest.raises(ValueError, match="feature rows"):
        HiddenStateBuffer(max_tokens=100).add(torch.arange(10), torch.zeros(4, 4))
    with pytest.raises(ValueError, match="2 token sequences but 1 feature"):
        HiddenStateBuffer(max_tokens=100).extend([[1, 2], [3, 4]], [torch.zeros(1, 4)])


def test_buffered_sequences_pack_directly_oldest_first():
    buffer = HiddenStateBuffer(max_tokens=100)
    buffer.extend([torch.arange(6), torch.arange(9)], [torch.zeros(5, 4), torch.ones(8, 4)])
    packs = pack_sequences(buffer.sequences(), max_tokens=64)
    assert len(packs) == 1 and packs[0].num_tokens == 4 + 7 and packs[0].sequence_index_s == [0, 1]


def test_the_features_a_pipeline_stage_shares_are_what_an_empty_buffer_would_keep():
    """rl/actor.py sends the other pipeline stages only the newest sequences that fit the buffer."""
    from megatron_tlt.rl.actor import newest_that_fit

    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        budget = int(torch.randint(1, 30, (), generator=generator))
        rows = torch.randint(1, 40, (int(torch.randint(0, 8, (), generator=generator)),), generator=generator).tolist()
        buffer = HiddenStateBuffer(max_tokens=budget)
        for i, n in enumerate(rows):
            buffer.add(*_sequence(n, i))
        sequences = [[0] * (n + 1) for n in rows]
        assert newest_that_fit(sequences, budget) == _tags(buffer), (budget, rows)
