"""Which sequences the drafter's held-out measure takes (rl/held_out_slice.py)."""

from types import SimpleNamespace

from megatron_tlt.rl.held_out_slice import choose


def _samples(groups: int, n: int, prompt_len: int = 5, response_len: int = 10):
    return [SimpleNamespace(prompt_index=g, sample_index=j, prompt_ids=[1] * prompt_len,
                            response_ids=[2] * response_len) for g in range(groups) for j in range(n)]


def test_the_slice_is_the_first_sample_of_every_group_in_prompt_order():
    samples = _samples(groups=4, n=3)
    assert choose(samples, quality_rows=10_000) == [0, 3, 6, 9]


def test_the_slice_stops_once_it_holds_the_rows_asked_for_and_off_is_empty():
    samples = _samples(groups=4, n=3)  # 14 feature rows a sequence
    assert choose(samples, quality_rows=20) == [0, 3]  # whole sequences: the last one may pass the bound
    assert choose(samples, quality_rows=14) == [0]
    assert choose(samples, quality_rows=0) == []
