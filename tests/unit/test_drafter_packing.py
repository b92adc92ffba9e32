import pytest
import torch

from megatron_tlt.drafter.model import EagleDrafter
from megatron_tlt.drafter.packing import eagle_examples, pack_sequences
from megatron_tlt.formats.architecture import architecture_from_dict
from tiny_models import TINY_LLAMA

LLAMA = architecture_from_dict(TINY_LLAMA)
H = LLAMA.hidden_size


def _sequence(num_tokens: int, seed: int):
    """Random token ids and the L - 1 feature rows the log-prob pass captures for them."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, LLAMA.vocab_size, (num_tokens,), generator=g), torch.randn(num_tokens - 1, H, generator=g)


def _run(drafter, embed, pack):
    with torch.no_grad():
        return drafter(embed[pack.input_ids_t], pack.features_th, pack.position_ids_t, pack.segment_ids_t)


def _segment_rows(pack, sequence_index):
    segment = pack.sequence_index_s.index(sequence_index)
    return pack.segment_ids_t == segment


def test_example_at_position_t_reads_token_t_plus_1_and_feature_t_and_predicts_feature_t_plus_1():
    tokens = torch.tensor([10, 11, 12, 13, 14, 15])
    features = torch.arange(5.0)[:, None].expand(5, 3)  # f_t = t, for t = 0 .. L-2 (the log-prob pass's rows)
    examples = eagle_examples(tokens, features)
    assert examples.input_ids_t.tolist() == [11, 12, 13, 14]
    assert examples.features_th[:, 0].tolist() == [0, 1, 2, 3]
    assert examples.target_features_th[:, 0].tolist() == [1, 2, 3, 4]
    assert examples.position_ids_t.tolist() == [0, 1, 2, 3]
    with_last = eagle_examples(tokens, torch.arange(6.0)[:, None])  # a feature for every token: one more row
    assert with_last.input_ids_t.tolist() == [11, 12, 13, 14, 15]
    assert with_last.target_features_th[:, 0].tolist() == [1, 2, 3, 4, 5]


def test_token_and_feature_counts_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="needs 5 \\(or 6\\) feature rows, got 3"):
        eagle_examples(torch.arange(6), torch.zeros(3, 4))


def test_packs_hold_at_most_max_tokens_keep_every_example_and_restart_positions():
    sequences = [_sequence(n, seed) for seed, n in enumerate([30, 12, 25, 3, 2, 40])]
    packs = pack_sequences(sequences, max_tokens=48)
    assert all(p.num_tokens <= 48 for p in packs)
    assert sum(p.num_tokens for p in packs) == sum(len(ids) - 2 for ids, _ in sequences if len(ids) > 2)
    for pack in packs:
        for segment, index in enumerate(pack.sequence_index_s):
            rows = pack.segment_ids_t == segment
            assert rows.nonzero().flatten().diff().eq(1).all(), "a segment's rows must be contiguous"
            expected = eagle_examples(*sequences[index])
            assert pack.position_ids_t[rows].tolist() == list(range(expected.num_tokens))
            assert torch.equal(pack.input_ids_t[rows], expected.input_ids_t)
            assert torch.equal(pack.features_th[rows], expected.features_th)
            assert torch.equal(pack.target_features_th[rows], expected.target_features_th)
    assert 4 not in {i for p in packs for i in p.sequence_index_s}  # 2 tokens, 1 feature: no example


def test_a_sequence_longer_than_a_pack_is_split_into_chunks_that_keep_their_positions():
    tokens, features = _sequence(26, seed=0)  # 24 examples
    packs = pack_sequences([(tokens, features)], max_tokens=10)
    assert [p.num_tokens for p in packs] == [10, 10, 4]
    assert torch.cat([p.position_ids_t for p in packs]).tolist() == list(range(24))
    assert torch.equal(torch.cat([p.input_ids_t for p in packs]), tokens[1:25])


def test_changing_one_sequence_leaves_the_others_in_its_pack_unchanged():
    drafter = EagleDrafter(LLAMA, seed=0)
    embed = torch.randn(LLAMA.vocab_size, H)
    sequences = [_sequence(n, seed) for seed, n in enumerate([20, 33, 17])]
    (pack,) = pack_sequences(sequences, max_tokens=128)
    changed_tokens = (sequences[1][0] + 7) % LLAMA.vocab_size
    changed = [sequences[0], (changed_tokens, torch.randn(32, H)), sequences[2]]
    (changed_pack,) = pack_sequences(changed, max_tokens=128)
    out, changed_out = _run(drafter, embed, pack), _run(drafter, embed, changed_pack)
    for index in (0, 2):
        rows = _segment_rows(pack, index)
        torch.testing.assert_close(changed_out[rows], out[rows], atol=1e-6, rtol=0)
    rows = _segment_rows(pack, 1)
    assert (changed_out[rows] - out[rows]).abs().max() > 0.1


def test_packed_output_of_a_sequence_equals_running_it_alone():
    torch.manual_seed(0)  # the perturbation below draws from the global generator
    drafter = EagleDrafter(LLAMA, seed=0)
    with torch.no_grad():
        for param in drafter.parameters():
            param.add_(torch.randn_like(param) * 0.2)  # make attention matter
    embed = torch.randn(LLAMA.vocab_size, H)
    sequences = [_sequence(n, seed) for seed, n in enumerate([20, 33, 17, 9])]
    (pack,) = pack_sequences(sequences, max_tokens=128)
    packed_out = _run(drafter, embed, pack)
    for index, sequence in enumerate(sequences):
        (alone,) = pack_sequences([sequence], max_tokens=128)
        # equal up to float32 summation order (a leak across segments moves outputs by > 0.1)
        torch.testing.assert_close(packed_out[_segment_rows(pack, index)], _run(drafter, embed, alone),
                                   atol=1e-4, rtol=1e-4)


def test_lazy_packing_builds_packs_as_asked_and_covers_every_row_once():
    from megatron_tlt.drafter.packing import iter_packs

    generator = torch.Generator().manual_seed(3)
    sequences = [(torch.randint(0, 50, (n,), generator=generator), torch.randn(n - 1, 8, generator=generator))
                 for n in (30, 12, 45, 7, 60, 25, 33, 18, 51, 9)]
    read = []

    def source():
        for i, sequence in enumerate(sequences):
            read.append(i)
            yield sequence

    stream = iter_packs(source(), 64, open_packs=2)
    first = next(stream)
    assert len(read) < len(sequences)  # the first pack came before the input was all read
    packs = [first, *stream]
    assert all(p.num_tokens <= 64 for p in packs)
    rows = sorted((i, int(pos)) for p in packs for seg, i in enumerate(p.sequence_index_s)
                  for pos in p.position_ids_t[p.segment_ids_t == seg])
    want = sorted((i, t) for i, (ids, _) in enumerate(sequences) for t in range(len(ids) - 2))
    assert rows == want
    assert len(packs) <= len(pack_sequences(sequences, 64)) + 2  # nearly as tight as first fit over all


def test_fp8_packs_are_padded_to_16_rows_with_a_segment_of_their_own_and_others_are_left_alone():
    from megatron_tlt.drafter.packing import pad_rows
    from megatron_tlt.drafter.precision import DrafterPrecision
    from megatron_tlt.drafter.trainer import row_multiple

    cpu = torch.device("cpu")
    assert row_multiple(DrafterPrecision(cpu, torch.bfloat16, fp8_backend="torchao")) == 16
    assert row_multiple(DrafterPrecision(cpu, torch.bfloat16, fp8_backend="transformer_engine")) == 16
    assert row_multiple(DrafterPrecision(cpu, torch.bfloat16)) == 1
    assert row_multiple(DrafterPrecision(cpu, torch.float32)) == 1
    (pack,) = pack_sequences([_sequence(n, seed) for seed, n in enumerate([20, 9])], max_tokens=128)  # 18 + 7 rows
    padded = pad_rows(pack, 16)
    assert (pack.num_tokens, padded.num_tokens) == (25, 32)
    for name in ("input_ids_t", "features_th", "target_features_th", "position_ids_t", "segment_ids_t"):
        assert torch.equal(getattr(padded, name)[:25], getattr(pack, name))
    assert padded.segment_ids_t[25:].tolist() == [2] * 7 and padded.sequence_index_s == pack.sequence_index_s
    assert not padded.features_th[25:].any() and not padded.input_ids_t[25:].any()
    assert pad_rows(pack, 1) is pack and pad_rows(padded, 16) is padded


def test_padding_rows_change_neither_the_real_rows_output_nor_the_drafter_loss(monkeypatch):
    from megatron_tlt.config import DrafterConfig
    from megatron_tlt.drafter import trainer as trainer_module
    from megatron_tlt.drafter.packing import pad_rows

    drafter = EagleDrafter(LLAMA, seed=0)
    embed = torch.randn(LLAMA.vocab_size, H)
    sequences = [_sequence(n, seed) for seed, n in enumerate([20, 9])]
    (pack,) = pack_sequences(sequences, max_tokens=128)
    torch.testing.assert_close(_run(drafter, embed, pad_rows(pack, 16))[:pack.num_tokens], _run(drafter, embed, pack),
                               atol=1e-5, rtol=1e-5)
    settings = DrafterConfig(lr=1e-3, buffer_tokens=256, pack_tokens=128, hidden_weight=1.0, ce_weight=0.1)
    trainer = trainer_module.DrafterTrainer(LLAMA, settings, seed=0)
    trainer.set_policy_heads({"model.embed_tokens.weight": embed})
    token_ids, features = [ids.tolist() for ids, _ in sequences], [f for _, f in sequences]
    plain = trainer.evaluate(token_ids, features)
    monkeypatch.setattr(trainer_module, "row_multiple", lambda precision: 16)  # the FP8 rule, on an fp32 drafter
    padded = trainer.evaluate(token_ids, features)
    assert padded["tokens"] == plain["tokens"] == 25
    assert padded["loss_sum"] == pytest.approx(plain["loss_sum"], rel=1e-5)
    assert padded["top1_sum"] == plain["top1_sum"]


def _trainer(unroll_steps: int, embed):
    from megatron_tlt.config import DrafterConfig
    from megatron_tlt.drafter.trainer import DrafterTrainer

    settings = DrafterConfig(lr=1e-3, buffer_tokens=256, pack_tokens=128, unroll_steps=unroll_steps)
    trainer = DrafterTrainer(LLAMA, settings, seed=0)
    trainer.set_policy_heads({"model.embed_tokens.weight": embed})
    return trainer


def test_unrolled_training_loss_is_the_mean_of_each_draft_steps_loss_on_its_valid_rows(monkeypatch):
    from megatron_tlt.drafter import trainer as trainer_module
    from megatron_tlt.drafter.loss import drafter_loss

    embed = torch.randn(LLAMA.vocab_size, H, generator=torch.Generator().manual_seed(5))
    sequences = [_sequence(n, seed) for seed, n in enumerate([20, 9, 3])]
    token_ids, features = [ids.tolist() for ids, _ in sequences], [f for _, f in sequences]
    (pack,) = pack_sequences(sequences, max_tokens=128)
    once, unrolled = _trainer(1, embed), _trainer(3, embed)
    drafter = once.drafter
    with torch.no_grad():
        first = drafter(embed[pack.input_ids_t], pack.features_th, pack.position_ids_t, pack.segment_ids_t)
        plain_loss, _ = drafter_loss(first, pack.target_features_th, embed)
        predictions, valid = drafter.unroll(embed[pack.input_ids_t], pack.features_th, pack.position_ids_t,
                                            pack.segment_ids_t, 3)
        expected = sum(float(drafter_loss(p[v], pack.target_features_th[v], embed)[0])
                       for p, v in zip(predictions, valid)) / 3
    # unroll_steps=1 is EAGLE-1's loss, unchanged; the 3-token sequence has one row, in step 1 only
    assert pack.num_tokens == 18 + 7 + 1
    assert once.evaluate(token_ids, features)["loss_sum"] == pytest.approx(float(plain_loss) * 26, rel=1e-5)
    assert [int(v.sum()) for v in valid] == [26, 17 + 6, 16 + 5]
    result = unrolled.evaluate(token_ids, features)
    assert result["loss_sum"] == pytest.approx(expected * 26, rel=1e-5)
    assert result["top1_sum"] == once.evaluate(token_ids, features)["top1_sum"]  # step 1's agreement
    monkeypatch.setattr(trainer_module, "row_multiple", lambda precision: 16)  # padding rows stay out of every step
    assert unrolled.evaluate(token_ids, features)["loss_sum"] == pytest.approx(result["loss_sum"], rel=1e-5)


def test_unrolled_training_steps_on_packs_too_short_to_unroll():
    embed = torch.randn(LLAMA.vocab_size, H, generator=torch.Generator().manual_seed(5))
    trainer = _trainer(4, embed)
    short = [_sequence(3, seed) for seed in range(4)]  # one row each: steps 2-4 have no valid row
    trainer.add_sequences([ids.tolist() for ids, _ in short], [f for _, f in short])
    before = [p.detach().clone() for p in trainer.drafter.parameters()]
    assert trainer.micro_step() == 4
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.drafter.parameters()))
