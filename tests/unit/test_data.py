"""Prompt datasets: JSONL/JSON/Parquet rows, chat rendering, bad-row accounting, DP sharding and resume."""

import json
import logging

import pytest

from megatron_tlt.formats.tokenizer import load_tokenizer, train_sentencepiece
from megatron_tlt.rl.inputs.data import DataError, PromptDataConfig, PromptExample, load_prompt_dataset
from megatron_tlt.rl.inputs.sampler import PromptSampler

# Rejects chats that do not start with the user, to exercise a template refusing a row.
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] not in ['user', 'system'] %}{{ raise_exception('chat must start with user') }}"
    "{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("tok") / "sp"
    sentences = [f"What is {a} plus {b}? The answer is {a + b}." for a in range(20) for b in range(10)]
    train_sentencepiece(sentences, out_dir, vocab_size=300)
    return out_dir


@pytest.fixture(scope="module")
def plain_tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def chat_tokenizer(tokenizer_dir, tmp_path_factory):
    chat_dir = tmp_path_factory.mktemp("tok") / "chat"
    chat_dir.mkdir()
    (chat_dir / "tokenizer.model").write_bytes((tokenizer_dir / "tokenizer.model").read_bytes())
    (chat_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return load_tokenizer(chat_dir)


def write_jsonl(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def test_plain_text_rows_become_examples_with_bos_ground_truth_and_source(tmp_path, plain_tokenizer):
    path = write_jsonl(tmp_path / "plain.jsonl", [
        {"prompt": "What is 1 plus 2?", "answer": "3", "data_source": "synthetic"},
        {"prompt": "What is 4 plus 5?", "ground_truth": 9},
    ])
    dataset = load_prompt_dataset(path, plain_tokenizer)
    assert len(dataset) == 2 and dataset.report.num_skipped == 0
    assert dataset[0] == PromptExample(
        index=0,
        prompt_ids=tuple(plain_tokenizer.encode("What is 1 plus 2?", add_bos=True)),
        ground_truth="3",
        data_source="synthetic",
    )
    assert dataset[0].prompt_ids[0] == plain_tokenizer.bos_id
    assert (dataset[1].index, dataset[1].ground_truth, dataset[1].data_source) == (1, "9", None)
    with pytest.raises(AttributeError):
        dataset[0].ground_truth = "4"  # frozen


def test_chat_rows_are_rendered_with_the_template_and_verl_nested_ground_truth(tmp_path, chat_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 plus 2?"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [
        {"data_source": "gsm8k", "prompt": messages, "reward_model": {"style": "rule", "ground_truth": "4"}},
    ])
    (example,) = load_prompt_dataset(path, chat_tokenizer).examples
    text = "<|system|>Be brief.</s><|user|>What is 2 plus 2?</s><|assistant|>"
    assert chat_tokenizer.apply_chat_template(messages) == text
    assert example.prompt_ids == tuple(chat_tokenizer.encode(text))
    assert example.prompt_ids.count(chat_tokenizer.eos_id) == 2
    assert (example.ground_truth, example.data_source) == ("4", "gsm8k")


def test_configured_keys_replace_the_verl_defaults(tmp_path, plain_tokenizer):
    path = write_jsonl(tmp_path / "custom.jsonl", [
        {"question": "What is 3 plus 3?", "meta": {"solution": "6"}, "answer": "wrong", "origin": "mine"},
    ])
    config = PromptDataConfig(prompt_key="question", ground_truth_keys=["meta.solution"], data_source_key="origin",
                              add_bos_to_text=False)
    (example,) = load_prompt_dataset(path, plain_tokenizer, config).examples
    assert example.prompt_ids == tuple(plain_tokenizer.encode("What is 3 plus 3?"))
    assert (example.ground_truth, example.data_source) == ("6", "mine")


def test_each_kind_of_bad_row_is_counted_by_reason_reported_and_skipped(tmp_path, chat_tokenizer, caplog):
    good = {"prompt": "What is 1 plus 1?", "answer": "2"}
    rows = [
        good,                                                                  # line 1
        "{not json",                                                           # 2 invalid_json
        [1, 2],                                                                # 3 not_an_object
        {"answer": "2"},                                                       # 4 missing_prompt
        {"prompt": "   ", "answer": "2"},                                      # 5 empty_prompt
        {"prompt": [], "answer": "2"},                                         # 6 empty_prompt
        {"prompt": [{"role": "user"}], "answer": "2"},                         # 7 bad_messages
        {"prompt": 7, "answer": "2"},                                          # 8 bad_messages
        {"prompt": [{"role": "assistant", "content": "hi"}], "answer": "2"},   # 9 bad_messages (template refused)
        {"prompt": "What is 1 plus 1?"},                                       # 10 missing_ground_truth
        {"prompt": "What is 1 plus 1?", "reward_model": {"ground_truth": ""}},  # 11 missing_ground_truth
        {"prompt": "What is 1 plus 1?", "answer": ["2"]},                      # 12 bad_ground_truth
        {"prompt": "What is 1 plus 1? " * 40, "answer": "2"},                  # 13 prompt_too_long
        {"prompt": [{"role": "user", "content": "What is 5 plus 5?"}], "answer": "10"},  # 14 good chat
    ]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="megatron_tlt.rl.inputs.data"):
        dataset = load_prompt_dataset(path, chat_tokenizer, PromptDataConfig(max_prompt_tokens=64))
    report = dataset.report
    assert (report.num_rows, report.num_kept, report.num_skipped) == (14, 2, 12)
    assert report.skipped == {
        "invalid_json": 1, "not_an_object": 1, "missing_prompt": 1, "empty_prompt": 2, "bad_messages": 3,
        "missing_ground_truth": 2, "bad_ground_truth": 1, "prompt_too_long": 1,
    }
    assert report.first_bad_rows["empty_prompt"] == (5, 6)
    assert report.first_bad_rows["bad_messages"] == (7, 8, 9)
    assert report.first_bad_rows["prompt_too_long"] == (13,)
    assert [(e.index, e.ground_truth) for e in dataset.examples] == [(0, "2"), (1, "10")]
    (record,) = caplog.records
    assert "\n" not in record.getMessage()
    assert str(path) in record.getMessage() and "bad_messages 3 (rows 7, 8, 9)" in record.getMessage()


def test_first_bad_rows_are_capped_but_every_bad_row_is_counted(tmp_path, plain_tokenizer):
    rows = [{"prompt": "What is 1 plus 1?", "answer": "2"}] + [{"prompt": ""}] * 8
    report = load_prompt_dataset(write_jsonl(tmp_path / "many.jsonl", rows), plain_tokenizer).report
    assert report.skipped == {"empty_prompt": 8}
    assert report.first_bad_rows["empty_prompt"] == (2, 3, 4, 5, 6)
    assert "empty_prompt 8 (rows 2, 3, 4, 5, 6, ...)" in report.summary()


def test_a_file_without_usable_rows_raises_naming_the_file_and_reasons(tmp_path, plain_tokenizer):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": ""}, {"prompt": "hi"}, "oops"])
    with pytest.raises(DataError, match="no usable prompt rows") as info:
        load_prompt_dataset(path, plain_tokenizer)
    assert str(path) in str(info.value)
    assert "empty_prompt 1" in str(info.value) and "missing_ground_truth 1" in str(info.value)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="has no rows"):
        load_prompt_dataset(empty, plain_tokenizer)


def test_missing_files_unknown_formats_and_chat_without_template_are_errors(tmp_path, plain_tokenizer):
    with pytest.raises(DataError, match="does not exist"):
        load_prompt_dataset(tmp_path / "nope.jsonl", plain_tokenizer)
    csv = tmp_path / "rows.csv"
    csv.write_text("prompt,answer\n")
    with pytest.raises(DataError, match="unknown prompt file format '.csv'"):
        load_prompt_dataset(csv, plain_tokenizer)
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}])
    with pytest.raises(DataError, match="row 1 has chat messages but the tokenizer .* has no chat template"):
        load_prompt_dataset(chat, plain_tokenizer)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        PromptDataConfig(max_prompt_tokens=0)


def test_json_files_may_hold_an_array_or_json_lines(tmp_path, plain_tokenizer):
    rows = [{"prompt": "What is 1 plus 1?", "answer": "2"}, 5]
    array = tmp_path / "array.json"
    array.write_text(json.dumps(rows))
    lines = write_jsonl(tmp_path / "lines.json", rows)
    for path in (array, lines):
        dataset = load_prompt_dataset(path, plain_tokenizer)
        assert len(dataset) == 1 and dataset.report.skipped == {"not_an_object": 1}


def test_verl_parquet_files_load_like_jsonl(tmp_path, chat_tokenizer):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed; Parquet prompt files need it")
    import pyarrow.parquet as pq

    rows = [
        {"data_source": "gsm8k", "prompt": [{"role": "user", "content": f"What is {i} plus 1?"}],
         "reward_model": {"style": "rule", "ground_truth": str(i + 1)}}
        for i in range(3)
    ]
    rows[1]["prompt"] = []  # one bad row, to show Parquet rows are counted too
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    dataset = load_prompt_dataset(path, chat_tokenizer)
    assert dataset.report.skipped == {"empty_prompt": 1} and dataset.report.first_bad_rows == {"empty_prompt": (2,)}
    expected = chat_tokenizer.encode(chat_tokenizer.apply_chat_template(rows[2]["prompt"]))
    assert dataset[1] == PromptExample(index=1, prompt_ids=tuple(expected), ground_truth="3", data_source="gsm8k")


def take(sampler, num_steps):
    return [next(sampler) for _ in range(num_steps)]


def test_dp_ranks_cover_every_index_exactly_once_per_epoch_without_overlap():
    num_examples, batch_prompts, dp_size = 24, 8, 4
    samplers = [PromptSampler(num_examples, batch_prompts=batch_prompts, dp_rank=r, dp_size=dp_size, seed=3)
                for r in range(dp_size)]
    steps_per_epoch = samplers[0].steps_per_epoch
    assert steps_per_epoch == 3
    epochs = []
    for _ in range(2):
        per_rank = [take(s, steps_per_epoch) for s in samplers]
        assert all(len(batch) == batch_prompts // dp_size for batches in per_rank for batch in batches)
        seen = [i for batches in per_rank for batch in batches for i in batch]
        assert sorted(seen) == list(range(num_examples))  # every index once, no rank overlaps another
        epochs.append(seen)
    assert epochs[0] != epochs[1]  # reshuffled each epoch
    assert all(s.epoch == 2 and s.step == 0 for s in samplers)


def test_a_remainder_is_left_out_of_one_epoch_only_and_no_index_repeats():
    sampler = PromptSampler(10, batch_prompts=4, dp_rank=0, dp_size=1, seed=0)
    first, second = take(sampler, 2), take(sampler, 2)
    for epoch in (first, second):
        flat = [i for batch in epoch for i in batch]
        assert len(set(flat)) == len(flat) == 8
    assert set(range(10)) - {i for b in first for i in b} != set(range(10)) - {i for b in second for i in b}
    ordered = PromptSampler(10, batch_prompts=4, dp_rank=1, dp_size=2, seed=0, shuffle=False)
    assert take(ordered, 3) == [[2, 3], [6, 7], [2, 3]]


def test_same_seed_gives_same_batches_and_another_seed_differs():
    a, b = (PromptSampler(50, batch_prompts=10, dp_rank=1, dp_size=2, seed=7) for _ in range(2))
    c = PromptSampler(50, batch_prompts=10, dp_rank=1, dp_size=2, seed=8)
    assert take(a, 8) == take(b, 8) != take(c, 8)


def test_resuming_from_state_dict_reproduces_the_next_batches_across_an_epoch_boundary():
    sampler = PromptSampler(30, batch_prompts=6, dp_rank=1, dp_size=3, seed=11)
    take(sampler, 4)
    state = json.loads(json.dumps(sampler.state_dict()))  # checkpoints store it as plain data
    assert (state["epoch"], state["step"]) == (0, 4)
    expected = take(sampler, 7)  # crosses from epoch 0 into epoch 1
    resumed = PromptSampler(30, batch_prompts=6, dp_rank=1, dp_size=3, seed=11)
    resumed.load_state_dict(state)
    assert take(resumed, 7) == expected


def test_resuming_on_another_dp_size_keeps_the_global_batches():
    def global_batches(dp_size, num_steps, state=None):
        samplers = [PromptSampler(24, batch_prompts=6, dp_rank=r, dp_size=dp_size, seed=5) for r in range(dp_size)]
        for s in samplers:
            if state is not None:
                s.load_state_dict(state)
        return [[i for batch in step for i in batch] for step in zip(*(take(s, num_steps) for s in samplers))]

    reference = global_batches(1, 8)
    assert global_batches(2, 8) == reference
    saved_on_two_ranks = PromptSampler(24, batch_prompts=6, dp_rank=0, dp_size=2, seed=5)
    take(saved_on_two_ranks, 3)
    assert global_batches(3, 5, saved_on_two_ranks.state_dict()) == reference[3:]


def test_loading_a_state_for_other_data_or_seed_is_refused():
    state = PromptSampler(30, batch_prompts=6, dp_rank=0, dp_size=1, seed=1).state_dict()
    with pytest.raises(ValueError, match="usable prompts 30 at the checkpoint, 29 now"):
        PromptSampler(29, batch_prompts=6, dp_rank=0, dp_size=1, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="trainer.seed 1 at the checkpoint, 2 now"):
        PromptSampler(30, batch_prompts=6, dp_rank=0, dp_size=1, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"trainer.prompts_per_step 6 at the checkpoint, 5 now \(resume with the same"):
        PromptSampler(30, batch_prompts=5, dp_rank=0, dp_size=1, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="out of range"):
        PromptSampler(30, batch_prompts=6, dp_rank=0, dp_size=1, seed=1).load_state_dict(state | {"step": 5})


def test_impossible_sampler_layouts_are_rejected_naming_the_setting_to_change():
    with pytest.raises(ValueError, match=r"trainer.prompts_per_step \(6\) must be a positive multiple of "
                                         r"parallel.data_parallel_size \(4\)"):
        PromptSampler(30, batch_prompts=6, dp_rank=0, dp_size=4, seed=0)
    with pytest.raises(ValueError, match="dp_rank must be in"):
        PromptSampler(30, batch_prompts=6, dp_rank=2, dp_size=2, seed=0)
    with pytest.raises(ValueError) as too_few:
        PromptSampler(5, batch_prompts=6, dp_rank=0, dp_size=1, seed=0)
    assert str(too_few.value) == ("the dataset has 5 usable prompts, fewer than one step takes "
                                  "(trainer.prompts_per_step=6): set trainer.prompts_per_step to at most 5 or add data")


def test_the_data_keys_of_a_prompt_file_are_config_keys_a_run_can_set():
    from megatron_tlt.config import ConfigError, load_config

    data = load_config("tiny", ["data.prompt_key=question", "data.ground_truth_keys=[meta.solution,answer]",
                                "data.data_source_key=origin", "data.add_bos_to_text=false",
                                "data.max_prompt_tokens=64"]).data
    assert PromptDataConfig.from_config(data) == PromptDataConfig(
        prompt_key="question", ground_truth_keys=("meta.solution", "answer"), data_source_key="origin",
        max_prompt_tokens=64, add_bos_to_text=False)
    with pytest.raises(ConfigError, match=r"data.ground_truth_keys is empty"):
        load_config("tiny", ["data.ground_truth_keys=[]"])


def test_a_held_out_file_is_read_as_the_prompt_file_is_and_prompts_it_shares_with_it_are_said(tmp_path, caplog):
    """data.held_out_path: the prompts a run on a prompt file measures its accuracy on (VeRL's val_files)."""
    from tiny_models import make_tiny_chat_model

    from megatron_tlt.config import ConfigError, load_config
    from megatron_tlt.rl.inputs.pretrained_source import PretrainedSource

    rows = [{"prompt": [{"role": "user", "content": f"What is {a} plus 2?"}], "answer": str(a + 2)} for a in range(8)]
    hf_dir = make_tiny_chat_model(tmp_path / "hf", [row["prompt"][0]["content"] for row in rows])
    train = write_jsonl(tmp_path / "train.jsonl", rows[:6])
    held_out = write_jsonl(tmp_path / "held_out.jsonl", rows[4:] + ["{not json"])
    config = load_config("hf", [f"model.hf_dir={hf_dir}", f"data.path={train}", f"data.held_out_path={held_out}"])
    with caplog.at_level(logging.WARNING):
        task = PretrainedSource(config).load_task()
    assert [e.ground_truth for e in task.held_out] == ["6", "7", "8", "9"]  # the bad row counted and skipped
    assert "2 of its 4 prompts are also in data.path" in caplog.text
    without = load_config("hf", [f"model.hf_dir={hf_dir}", f"data.path={train}"])
    assert PretrainedSource(without).load_task().held_out == []
    with pytest.raises(ConfigError, match=r"data.held_out_path needs data.path"):
        load_config("tiny", [f"data.held_out_path={held_out}"])
