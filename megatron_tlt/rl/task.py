"""What a run trains on: the tokenizer, the policy's architecture, the prompts and held-out prompts.

Either the built-in tiny task (tokenizer and prompts made by the code, cached) or an HF policy
directory with a prompt file. ``tlt train`` and ``tlt warmup-drafter`` load it the same way.
"""

from __future__ import annotations

import dataclasses

from megatron_tlt.config import RolloutEngineConfig, TLTConfig
from megatron_tlt.layout_rules import resolve_engine_tp
from megatron_tlt.model_config import PolicyArchitecture, load_architecture
from megatron_tlt.rl import tiny_default
from megatron_tlt.rl.data import PromptDataConfig, PromptDataset, PromptExample, load_prompt_dataset
from megatron_tlt.spec.engine import SamplingSettings
from megatron_tlt.tokenizer import Tokenizer, load_tokenizer


@dataclasses.dataclass(frozen=True)
class Task:
    tokenizer: Tokenizer
    arch: PolicyArchitecture
    dataset: PromptDataset
    held_out: list[PromptExample]
    """Prompts never trained on, for evaluation (empty for a prompt file)."""


def load_task(config: TLTConfig) -> Task:
    if config.model.hf_dir is None:
        root = tiny_default.cache_root(config.warmup.cache_dir)
        tokenizer = tiny_default.load_task_tokenizer(root)
        shape = tiny_default.TaskShape.of(config)
        held_out = (tiny_default.held_out_prompts(tokenizer, config.data.held_out_prompts, config.warmup.corpus_size,
                                                  shape) if config.data.held_out_prompts else [])
        task = Task(tokenizer, tiny_default.policy_architecture(config, tokenizer),
                    tiny_default.rl_prompts(tokenizer, config.data.synthetic_prompts, shape), list(held_out))
    else:
        if config.data.path is None:
            raise ValueError("model.hf_dir needs a prompt file in data.path")
        tokenizer = load_tokenizer(config.model.hf_dir)
        dataset = load_prompt_dataset(config.data.path, tokenizer,
                                      PromptDataConfig(max_prompt_tokens=config.data.max_prompt_tokens))
        task = Task(tokenizer, load_architecture(config.model.hf_dir), dataset, [])
    if task.tokenizer.eos_id is None:
        raise ValueError(f"tokenizer {task.tokenizer.directory} has no EOS token: responses would never end")
    return task


def engine_config_for(config: TLTConfig, task: Task) -> RolloutEngineConfig:
    """The configured engine, its context length defaulting to the longest prompt plus a full response
    and its tensor parallelism to the policy's."""
    engine_config = dataclasses.replace(config.rollout.engine, tensor_parallel_size=resolve_engine_tp(
        config.rollout.engine.tensor_parallel_size, config.parallel.tensor_parallel_size))
    if engine_config.max_model_len is None:
        longest_prompt = max(len(e.prompt_ids) for e in task.dataset.examples + tuple(task.held_out))
        engine_config = dataclasses.replace(engine_config, max_model_len=min(
            task.arch.max_position_embeddings, longest_prompt + config.rollout.max_response_tokens))
    return engine_config


def sampling_settings(config: TLTConfig, tokenizer: Tokenizer, *, n: int, temperature: float,
                      seed: int | None) -> SamplingSettings:
    """The run's rollout sampling at ``temperature`` (greedy ignores top-p), ending at EOS."""
    r = config.rollout
    return SamplingSettings(n=n, temperature=temperature, top_p=r.top_p if temperature > 0 else 1.0,
                            max_tokens=r.max_response_tokens, stop_token_ids=[tokenizer.eos_id], seed=seed)
