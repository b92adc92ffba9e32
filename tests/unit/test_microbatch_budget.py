"""Length-sorted micro-batches, by count and by a padded-token budget (``trainer.micro_batch_tokens``)."""

from __future__ import annotations

import pytest

from megatron_tlt.config import ConfigError, load_config
from megatron_tlt.model.lm_training import length_sorted_chunks

# A long-tail batch: many short answers, a few long ones.
LENGTHS = [12, 300, 15, 11, 40, 13, 120, 14, 16, 10]


def chunks(**kwargs):
    return length_sorted_chunks(range(len(LENGTHS)), LENGTHS.__getitem__, same_width=False, **kwargs)


def test_by_count_the_sorted_items_are_cut_every_micro_batch_size():
    got = chunks(micro_batch_size=4)
    assert [[LENGTHS[i] for i in c] for c, _ in got] == [[10, 11, 12, 13], [14, 15, 16, 40], [120, 300]]
    assert [w for _, w in got] == [13, 40, 300]  # each padded to its own longest


def test_a_token_budget_puts_the_short_answers_many_to_a_micro_batch_and_the_tail_alone():
    got = chunks(micro_batch_size=64, max_tokens=128)
    assert [[LENGTHS[i] for i in c] for c, _ in got] == [[10, 11, 12, 13, 14, 15, 16], [40], [120], [300]]
    assert all(len(c) * w <= 128 or len(c) == 1 for c, w in got)  # one item over the budget still runs, alone
    assert sorted(i for c, _ in got for i in c) == list(range(len(LENGTHS)))  # every item exactly once


def test_the_budget_and_the_count_both_hold():
    got = chunks(micro_batch_size=3, max_tokens=128)
    assert max(len(c) for c, _ in got) == 3
    assert all(len(c) * w <= 128 or len(c) == 1 for c, w in got)


def test_with_one_width_for_all_the_budget_counts_the_longest():
    got = length_sorted_chunks(range(len(LENGTHS)), LENGTHS.__getitem__, 64, same_width=True, max_tokens=600)
    assert {w for _, w in got} == {300} and [len(c) for c, _ in got] == [2, 2, 2, 2, 2]


def test_a_budget_below_one_token_is_refused():
    with pytest.raises(ConfigError, match="trainer.micro_batch_tokens must be >= 1 or null, got 0"):
        load_config(None, ["trainer.micro_batch_tokens=0"])
