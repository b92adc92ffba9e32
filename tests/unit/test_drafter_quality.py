"""The teacher-forced acceptance measure (drafter/quality.py) on drafters whose acceptance is known exactly."""

import math

import pytest
import torch

from megatron_tlt.drafter.model import EagleDrafter
from megatron_tlt.drafter.quality import AcceptanceTally, acceptance_probability, measure
from megatron_tlt.formats.architecture import architecture_from_dict
from tiny_models import TINY_LLAMA, next_token_fixture

ARCH = architecture_from_dict(TINY_LLAMA)


def _fixture():
    """The next-token fixture with unit-RMS embedding rows, so that the policy's feature at a position is exactly
    its token's embedding (its final norm is the identity there) and the good drafter predicts it exactly."""
    fixture = next_token_fixture(ARCH)
    embed = fixture["target"]["model.embed_tokens.weight"]
    embed = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True))
    return fixture, embed, fixture["target"]["lm_head.weight"]


def _sequence(length: int, prompt_len: int, embed: torch.Tensor, seed: int = 0):
    tokens = torch.randint(0, ARCH.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
    return tokens.tolist(), embed[tokens[:-1]], prompt_len  # features of positions 0 .. len-2


def test_acceptance_probability_follows_verifications_rule_for_each_way_of_drafting():
    target = torch.tensor([[2.0, 1.0, 0.0]])
    draft = torch.tensor([[0.0, 1.0, 2.0]])
    p, q = torch.softmax(target, -1), torch.softmax(draft, -1)
    probabilistic = acceptance_probability(draft, target, temperature=1.0, greedy_draft=False)
    assert probabilistic.item() == pytest.approx(torch.minimum(p, q).sum().item())
    greedy = acceptance_probability(draft, target, temperature=1.0, greedy_draft=True)
    assert greedy.item() == pytest.approx(p[0, 2].item())  # the draft's argmax, at the target's probability
    assert acceptance_probability(draft, target, temperature=0.0, greedy_draft=False).item() == 0.0
    assert acceptance_probability(target, target, temperature=0.0, greedy_draft=False).item() == 1.0
    sharper = acceptance_probability(draft, target, temperature=0.5, greedy_draft=False)
    assert sharper.item() < probabilistic.item()  # temperature applies to both distributions


@pytest.mark.parametrize("depth", [1, 4])
def test_a_drafter_that_predicts_the_policy_exactly_is_accepted_to_full_depth(depth):
    fixture, embed, lm_head = _fixture()
    good = EagleDrafter.from_tensors(ARCH, fixture["good_drafter"])
    sequences = [_sequence(40, 10, embed, seed=0), _sequence(25, 5, embed, seed=1)]
    tally = measure(good, sequences, embedding_vh=embed, lm_head_vh=lm_head, depth=depth, temperature=1.0,
                    greedy_draft=False, pack_tokens=1024)
    assert tally.expected_length == pytest.approx(depth + 1, abs=1e-4)
    assert tally.acceptance_by_position == pytest.approx([1.0] * depth, abs=1e-5)
    # chains start at rows t >= prompt_len - 2 and need rows t .. t + depth - 1 among the len - 2 examples
    assert tally.chains == sum(length - prompt_len - depth + 1 for length, prompt_len in ((40, 10), (25, 5)))
    assert tally.entropy_rows == (40 - 2 - 8) + (25 - 2 - 3)
    assert tally.mean_entropy > 0


def test_a_drafter_that_ignores_the_token_is_measured_far_below_the_good_one_and_deeper_positions_fall():
    fixture, embed, lm_head = _fixture()
    sequences = [_sequence(60, 10, embed)]
    kwargs = dict(embedding_vh=embed, lm_head_vh=lm_head, depth=3, temperature=1.0, greedy_draft=False,
                  pack_tokens=1024)
    good = measure(EagleDrafter.from_tensors(ARCH, fixture["good_drafter"]), sequences, **kwargs)
    bad = measure(EagleDrafter.from_tensors(ARCH, fixture["bad_drafter"]), sequences, **kwargs)
    assert bad.expected_length < good.expected_length - 1.0
    assert bad.expected_length >= 1.0  # the bonus token is always made
    by_position = bad.acceptance_by_position
    assert all(0.0 <= a < 1.0 for a in by_position)
    assert bad.mean_entropy == pytest.approx(good.mean_entropy)  # the policy's, whichever drafter


def test_packing_and_chunking_do_not_change_what_is_measured_inside_a_chunk():
    """Two sequences in one pack or each alone give the same tally: attention never crosses a segment."""
    fixture, embed, lm_head = _fixture()
    drafter = EagleDrafter(ARCH, seed=3)
    sequences = [_sequence(30, 6, embed, seed=0), _sequence(22, 4, embed, seed=1)]
    kwargs = dict(embedding_vh=embed, lm_head_vh=lm_head, depth=2, temperature=1.0, greedy_draft=False)
    together = measure(drafter, sequences, pack_tokens=1024, **kwargs)
    apart = measure(drafter, sequences, pack_tokens=28, **kwargs)  # each sequence its own pack
    assert apart.chains == together.chains
    assert apart.length_sum == pytest.approx(together.length_sum, rel=1e-5)


def test_tallies_add_and_survive_an_all_reduce_as_a_tensor():
    a = AcceptanceTally(2, [1.5, 0.5], length_sum=4.0, chains=2, entropy_sum=3.0, entropy_rows=3)
    b = AcceptanceTally(2, [0.5, 0.5], length_sum=2.0, chains=1, entropy_sum=1.0, entropy_rows=1)
    total = AcceptanceTally.from_tensor(2, a.as_tensor() + b.as_tensor())
    assert total == a + b
    assert total.expected_length == pytest.approx(2.0)
    assert total.acceptance_by_position == pytest.approx([2 / 3, 1 / 3])
    assert total.mean_entropy == pytest.approx(1.0)
    assert math.isnan(AcceptanceTally.empty(3).expected_length)
    with pytest.raises(ValueError, match="depths"):
        a + AcceptanceTally.empty(3)
