"""The tiny default follows its config: the policy's shape (``model.tiny``), the task's length tail
(``data.max_solution_steps``, ``data.length_tail``), and a warm-up cache entry per shape."""

import re

import pytest

from megatron_tlt.config import load_config
from megatron_tlt.formats.tokenizer import load_tokenizer
from megatron_tlt.rl.tiny import synthetic_task, tiny_default
from megatron_tlt.rl.tiny.tiny_source import warmed_up_dir

DEEP = ["model.tiny.num_layers=16", "model.tiny.hidden_size=64", "model.tiny.num_attention_heads=2",
        "model.tiny.num_key_value_heads=1", "model.tiny.intermediate_size=192"]
LONG_TAIL = ["data.max_solution_steps=40", "data.length_tail=1.3"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("tokenizer")
    synthetic_task.train_task_tokenizer(out_dir, seed=tiny_default.TOKENIZER_SEED)
    return load_tokenizer(out_dir)


def test_the_policy_has_the_configured_shape(tokenizer):
    arch = tiny_default.policy_architecture(load_config(None, DEEP), tokenizer)
    assert (arch.num_layers, arch.hidden_size, arch.num_attention_heads, arch.vocab_size) == (
        16, 64, 2, tokenizer.vocab_size)
    assert arch.hf_config["num_key_value_heads"] == 1 and arch.hf_config["intermediate_size"] == 192


def test_the_task_shape_sets_the_length_tail_and_the_longest_problem_fits_the_context(tokenizer):
    config = load_config(None, LONG_TAIL)
    shape = tiny_default.TaskShape.of(config)
    problems = shape.problems(4000, tiny_default.RL_PROMPT_SEED)
    assert max(p.num_steps for p in problems) == 40
    default = tiny_default.TaskShape().problems(4000, tiny_default.RL_PROMPT_SEED)
    assert max(p.num_steps for p in default) == synthetic_task.DEFAULT_MAX_STEPS
    dataset = tiny_default.rl_prompts(tokenizer, 64, shape)
    assert [e.prompt_ids for e in dataset.examples] == [
        tuple(tokenizer.encode(p.prompt, add_bos=True)) for p in problems[:64]]
    # prompt + worked solution + EOS of the longest problem within the policy's positions and the prompt limit
    longest = max(problems, key=lambda p: p.num_steps)
    assert len(tokenizer.encode(longest.prompt, add_bos=True)) <= config.data.max_prompt_tokens
    assert len(tokenizer.encode(longest.prompt + longest.solution, add_bos=True)) + 1 <= (
        config.model.tiny.max_position_embeddings)


def test_each_policy_and_task_shape_has_its_own_warm_up_and_the_default_keeps_its_entry(tokenizer, tmp_path):
    def entry(*overrides):
        return warmed_up_dir(load_config(None, [f"warmup.cache_dir={tmp_path}", *overrides]), tokenizer)

    checks = ["warmup.check_share=0.25"]
    entries = {entry(), entry(*DEEP), entry(*LONG_TAIL), entry(*DEEP, *LONG_TAIL), entry(*checks),
               entry(*checks, "rollout.max_response_tokens=96"), entry("model.tiny.max_position_embeddings=1024")}
    assert len(entries) == 7
    assert entry("rollout.max_response_tokens=96") == entry()  # without checks the budget shapes no demonstration
    # the key the tiny default had before its shape was configurable: its cached warm-up stays valid
    config = load_config(None, [f"warmup.cache_dir={tmp_path}"])
    warmup = {k: v for k, v in vars(config.warmup).items()
              if k not in ("cache_dir", "continue_optimizer", "use_shipped", "check_share")}  # settings made later
    before = tiny_default.cache_key(kind="warmup", policy=dict(
        tiny_default.TINY_POLICY_BASE, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512), vocab=tokenizer.vocab_size, warmup=warmup,
        seed=config.trainer.seed, dtype=config.model.dtype, attention=config.model.attention)
    assert entry(*[f"model.tiny.{k}={v}" for k, v in dict(
        num_layers=4, hidden_size=128, intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=2).items()]) == tmp_path / f"policy-{before}"


def test_restated_solutions_copy_the_remaining_expression_and_grow_quadratically():
    problem = next(p for p in synthetic_task.generate_problems(50, seed=4, style="restate") if p.num_steps == 3)
    expression = problem.prompt.removeprefix(synthetic_task.PROMPT_PREFIX).removesuffix(synthetic_task.PROMPT_SUFFIX)
    start, *operations = re.findall(r"^\d+|[+-]\d+", expression)
    expected, value = [expression], int(start)
    for i, operation in enumerate(operations):  # each line: the value so far, then what is left to do
        value += int(operation)
        expected.append(f"={value}" + "".join(operations[i + 1:]))
    expected.append(f"{synthetic_task.ANSWER_MARKER} {problem.answer}")
    assert problem.solution == " " + "\n".join(expected) and len(operations) == problem.num_steps == 3
    for style in synthetic_task.SOLUTION_STYLES:
        problems = synthetic_task.generate_problems(300, seed=1, style=style)
        assert all(synthetic_task.is_correct(p.prompt, p.solution) for p in problems)
    chain = synthetic_task.generate_problems(300, seed=1, max_steps=16)
    restate = synthetic_task.generate_problems(300, seed=1, max_steps=16, style="restate")
    assert [p.prompt for p in chain] == [p.prompt for p in restate]  # the same problems, written out differently
    longest = max(range(300), key=lambda i: chain[i].num_steps)
    assert len(restate[longest].solution) > 2 * len(chain[longest].solution)
