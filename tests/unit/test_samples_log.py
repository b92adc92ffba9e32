"""RUN_DIR/samples.jsonl (``rl/run/samples_log.py``): which samples, what a record holds, resume."""

from megatron_tlt.rl.run import samples_log
from megatron_tlt.rl.scoring import Sample


def _samples(prompts: int, n: int) -> list[Sample]:
    return [Sample(prompt_index=p, sample_index=j, prompt_ids=(1, 2 + p), response_ids=[7, 8, 9][: 1 + j],
                   finish_reason="stop" if j else "length", reward=float(j == 1),
                   rollout_logprobs=[-0.5, -0.25, -2.0][: 1 + j]) for p in range(prompts) for j in range(n)]


def test_one_response_per_prompt_first_then_the_next():
    picked = samples_log.pick(_samples(3, 2), 4)
    assert [(s.prompt_index, s.sample_index) for s in picked] == [(0, 0), (1, 0), (2, 0), (0, 1)]


def test_a_record_holds_the_texts_the_reward_and_the_token_ids():
    (record,) = samples_log.sample_records(5, _samples(1, 2)[1:], lambda ids: "|".join(map(str, ids)), 4)
    assert record == {"step": 5, "prompt": "1|2", "response": "7|8", "reward": 1.0, "finish_reason": "stop",
                      "response_tokens": 2, "prompt_ids": [1, 2], "response_ids": [7, 8],
                      "response_logprobs": [-0.5, -0.25]}
    table = samples_log.as_markdown([dict(record, response="a|b\nc")])
    assert table.splitlines()[2] == "| 1\\|2 | a\\|b<br>c | 1 | 2 (stop) |"


def test_a_resumed_run_drops_the_samples_past_its_checkpoint(tmp_path):
    for step in (1, 2, 3):
        samples_log.append(tmp_path, samples_log.sample_records(step, _samples(2, 1), str, 2))
    samples_log.truncate(tmp_path, 2)
    assert [r["step"] for r in samples_log.read(tmp_path)] == [1, 1, 2, 2]
