"""Drafter packs sized to a rank's idle windows (``drafter/pack_budget.py``), and the trainer packing to the rows
it is given. Pure numbers: the windows and step times are given, none is measured."""

import pytest
import torch

from megatron_tlt.config import DrafterConfig
from megatron_tlt.drafter.pack_budget import MIN_PACK_TOKENS, MIN_WINDOW_SECONDS, PackBudget
from megatron_tlt.drafter.trainer import DrafterTrainer
from megatron_tlt.formats.architecture import architecture_from_dict
from tiny_models import TINY_LLAMA

LLAMA = architecture_from_dict(TINY_LLAMA)


def test_packs_are_full_size_until_a_window_and_a_training_speed_are_known():
    budget = PackBudget(2048)
    assert budget.tokens(0.25) == 2048
    budget.record_window(6.0)
    assert budget.tokens(0.25) == 2048  # no speed yet
    budget = PackBudget(2048)
    budget.record_finished(512, 1.0)
    assert budget.tokens(0.25) == 2048  # no window yet


def test_the_real_models_cpu_run_a_2048_row_pack_dropped_in_its_window_sizes_the_next_rollouts_packs_to_fit():
    # bench/RESULTS.md, 2026-12-07: 2,048-row packs took 11 s, the windows 1-15 s (7.8 s in the first step)
    budget = PackBudget(2048)
    budget.record_dropped(2048, 7.7)  # it ran from just after the window began to its end, unfinished: >= 3.8 ms a row
    budget.record_window(7.8)
    # a micro-step of 0.5 x 0.25 x 7.8 s = 0.975 s at 3.8 ms a row is 259 rows, rounded down to a power of two
    assert budget.tokens(0.25) == 256
    budget.record_finished(256, 0.64)  # measured: 2.5 ms a row, the bound no longer used
    budget.record_window(5.6)
    # 0.5 x 0.25 x median(7.8, 5.6) = 0.8375 s / 2.5 ms = 335 rows, rounded down to a power of two
    assert budget.seconds_per_token == pytest.approx(0.0025)
    assert budget.tokens(0.25) == 256


def test_a_gpus_millisecond_micro_steps_keep_the_full_pack():
    budget = PackBudget(2048)
    budget.record_finished(2048, 0.042)  # Llama-3.3-70B drafter dims on an H200 took 42 ms for 1024 rows
    budget.record_window(2.0)
    assert budget.tokens(1.0) == 2048


def test_sizes_are_powers_of_two_within_the_bounds():
    budget = PackBudget(1000)
    budget.record_window(10.0)
    budget.record_finished(1000, 5.0)  # 5 ms a row: 0.5 x 1.0 x 10 s = 5 s is 1000 rows, the maximum
    assert budget.tokens(1.0) == 1000
    assert budget.tokens(0.5) == 256  # 500 rows, rounded down
    assert budget.tokens(0.01) == MIN_PACK_TOKENS  # 10 rows: never below the floor
    assert PackBudget(64).tokens(0.01) == 64  # a maximum under the floor is the floor
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        PackBudget(0)


def test_the_speed_is_the_mean_of_the_finished_steps_or_a_longer_bound_from_steps_dropped_since():
    budget = PackBudget(2048)
    budget.record_dropped(2048, 2.0)
    budget.record_dropped(1024, 4.0)
    assert budget.seconds_per_token == pytest.approx(4.0 / 1024)  # the tighter bound
    budget.record_finished(100, 0.1)
    budget.record_finished(300, 0.5)
    assert budget.seconds_per_token == pytest.approx(0.6 / 400)  # row-weighted; the bounds before it are done with
    budget.record_dropped(128, 0.01)  # started just before its window ended: a weak bound, outweighed
    assert budget.seconds_per_token == pytest.approx(0.6 / 400)
    budget.record_dropped(128, 10.0)  # training slowed: a whole window without finishing 128 rows
    assert budget.seconds_per_token == pytest.approx(10.0 / 128)
    budget.record_window(8.0)
    assert budget.tokens(0.25) == MIN_PACK_TOKENS  # the packs shrink again instead of dropping forever


def test_a_wait_too_short_for_any_micro_step_is_not_a_window():
    budget = PackBudget(2048)
    budget.record_finished(2048, 1.0)
    budget.record_window(MIN_WINDOW_SECONDS / 2)  # the slowest rank's barrier, on a loaded machine
    assert budget.median_window_seconds is None and budget.tokens(1.0) == 2048
    budget.record_window(MIN_WINDOW_SECONDS)
    assert budget.median_window_seconds == MIN_WINDOW_SECONDS


def _trainer(pack_tokens: int) -> tuple[DrafterTrainer, int]:
    g = torch.Generator().manual_seed(5)
    trainer = DrafterTrainer(LLAMA, DrafterConfig(lr=1e-3, buffer_tokens=4096, pack_tokens=pack_tokens), seed=0)
    trainer.set_policy_heads({"model.embed_tokens.weight": torch.randn(LLAMA.vocab_size, LLAMA.hidden_size,
                                                                         generator=g)})
    lengths = [30, 50, 20, 45, 60, 25]
    token_ids = [torch.randint(0, LLAMA.vocab_size, (n,), generator=g).tolist() for n in lengths]
    trainer.add_sequences(token_ids, [torch.randn(n - 1, LLAMA.hidden_size, generator=g) for n in lengths])
    return trainer, sum(n - 2 for n in lengths)


def test_the_trainer_packs_to_the_rows_it_is_given_and_covers_the_buffer_again():
    trainer, rows = _trainer(pack_tokens=256)
    assert trainer.packs_in_buffer() == 1  # 218 rows in one pack
    trainer.set_pack_tokens(64)
    assert trainer.pack_tokens == 64 and trainer.packs_in_buffer() >= 4
    trained = [trainer.micro_step() for _ in range(trainer.packs_in_buffer())]
    assert max(trained) <= 64 and sum(trained) == rows  # one pass over the buffer, every row once
    with pytest.raises(ValueError, match="pack rows must be >= 1"):
        trainer.set_pack_tokens(0)


def test_a_pack_dropped_before_a_resize_is_packed_again_with_the_rest():
    trainer, rows = _trainer(pack_tokens=256)
    assert trainer.micro_step(lambda: True) == 0 and trainer.dropped_steps == 1  # its whole pack waits for a retry
    trainer.set_pack_tokens(64)
    trained = [trainer.micro_step() for _ in range(trainer.packs_in_buffer())]
    assert max(trained) <= 64 and sum(trained) == rows  # the dropped rows come back in the smaller packs
