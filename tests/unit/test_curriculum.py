"""The easy-first curriculum: which prompts each stage draws, its resume, its settings' errors, and the cold start's
prompts under it."""

from types import SimpleNamespace

import pytest

from megatron_tlt.config import ConfigError, DataConfig
from megatron_tlt.rl.inputs.curriculum import CurriculumSampler, easy_positions, prompt_sampler
from megatron_tlt.rl.inputs.data import PromptExample
from megatron_tlt.rl.inputs.sampler import PromptSampler


def _examples(lengths):
    return [PromptExample(index=i, prompt_ids=tuple(range(n)), ground_truth="0", data_source="t")
            for i, n in enumerate(lengths)]


LENGTHS = [10, 30, 12, 40, 11, 50, 14, 60, 13, 70, 15, 80]  # even positions short, odd long


def _sampler(examples, easy_steps=3, rank=0, size=1):
    return prompt_sampler(examples, curriculum_steps=easy_steps, curriculum_max_prompt_tokens=15, batch_prompts=4,
                          dp_rank=rank, dp_size=size, seed=7)


def test_easy_positions_are_the_prompts_no_longer_than_the_bound_in_dataset_order():
    assert easy_positions(_examples(LENGTHS), 15) == [0, 2, 4, 6, 8, 10]
    assert easy_positions(_examples(LENGTHS), 9) == []


def test_the_first_steps_draw_only_easy_prompts_then_the_whole_set_as_a_run_without_a_curriculum_draws():
    examples = _examples(LENGTHS)
    sampler = _sampler(examples)
    easy = {0, 2, 4, 6, 8, 10}
    first = [next(sampler) for _ in range(3)]
    assert all(set(batch) <= easy and len(batch) == 4 for batch in first)
    plain = PromptSampler(len(examples), batch_prompts=4, dp_rank=0, dp_size=1, seed=7)
    later = [next(sampler) for _ in range(6)]
    assert later == [next(plain) for _ in range(6)]  # the full stage is the plain run's order from its step 1
    assert any(not set(batch) <= easy for batch in later)


def test_dp_ranks_split_each_easy_batch_without_overlap():
    examples = _examples(LENGTHS)
    a, b = _sampler(examples, rank=0, size=2), _sampler(examples, rank=1, size=2)
    for _ in range(3):
        x, y = next(a), next(b)
        assert len(x) == len(y) == 2 and not set(x) & set(y)


def test_a_resumed_curriculum_continues_in_its_stage_with_the_same_batches():
    examples = _examples(LENGTHS)
    first = _sampler(examples)
    for _ in range(2):
        next(first)
    state = first.state_dict()
    resumed = _sampler(examples)
    resumed.load_state_dict(state)
    assert [next(resumed) for _ in range(5)] == [next(first) for _ in range(5)]


def test_a_resume_with_another_curriculum_or_none_is_refused_by_name():
    examples = _examples(LENGTHS)
    with pytest.raises(ValueError, match="data.curriculum_steps"):
        _sampler(examples, easy_steps=4).load_state_dict(_sampler(examples).state_dict())
    plain = PromptSampler(len(examples), batch_prompts=4, dp_rank=0, dp_size=1, seed=7)
    with pytest.raises(ValueError, match="had no curriculum"):
        _sampler(examples).load_state_dict(plain.state_dict())


def test_without_a_curriculum_the_run_keeps_the_plain_sampler():
    assert type(prompt_sampler(_examples(LENGTHS), curriculum_steps=0, curriculum_max_prompt_tokens=0,
                               batch_prompts=4, dp_rank=0, dp_size=1, seed=7)) is PromptSampler


def test_too_few_easy_prompts_for_a_step_names_the_settings():
    with pytest.raises(ValueError, match="curriculum_max_prompt_tokens leaves 2 prompts.*prompts_per_step=4"):
        CurriculumSampler(12, [0, 2], 3, batch_prompts=4, dp_rank=0, dp_size=1, seed=7)


@pytest.mark.parametrize("steps, tokens", [(5, 0), (0, 15), (-1, 15)])
def test_the_curriculum_settings_go_together(steps, tokens):
    with pytest.raises(ConfigError, match="curriculum"):
        DataConfig(curriculum_steps=steps, curriculum_max_prompt_tokens=tokens)


def test_the_cold_start_trains_on_the_curriculums_first_prompts_and_measures_on_the_tasks_held_out():
    from megatron_tlt.commands.warmup_drafter import split_cold_start_prompts
    from megatron_tlt.config import ColdStartConfig
    from megatron_tlt.rl.inputs.data import DataReport, PromptDataset
    from megatron_tlt.rl.inputs.task import Task

    examples = _examples(LENGTHS)
    held_out = _examples([40, 50])
    dataset = PromptDataset(path=None, examples=tuple(examples),
                            report=DataReport(path=None, num_rows=12, num_kept=12, skipped={}, first_bad_rows={}))
    task = Task(SimpleNamespace(eos_id=2), None, dataset, held_out)
    settings = ColdStartConfig(prompts=100, eval_prompts=2)
    train, evaluate = split_cold_start_prompts(task, settings, curriculum_max_prompt_tokens=15)
    assert [e.index for e in train] == [0, 2, 4, 6, 8, 10] and evaluate == held_out
    train, _ = split_cold_start_prompts(task, settings)
    assert len(train) == 12
