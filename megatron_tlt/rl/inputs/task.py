"""What a run trains on (``Task``: the tokenizer, the policy's architecture, the prompts and held-out prompts)
and the one interface it comes from (``TaskSource``).

Two sources implement it: the built-in tiny default (``rl/tiny/tiny_source.py``: tokenizer, prompts and policy
made by the code, cached) and a user's model and data (``rl/inputs/pretrained_source.py``: an HF policy directory
with a prompt file); ``rl/task_source.task_source`` picks one. ``tlt train``, ``tlt warmup-drafter`` and
``tlt bench rollout`` load a task the same way.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol

from megatron_tlt.config import RolloutEngineConfig, TLTConfig
from megatron_tlt.formats.architecture import PolicyArchitecture
from megatron_tlt.formats.tokenizer import Tokenizer
from megatron_tlt.layout_rules import resolve_engine_tp
from megatron_tlt.rl.inputs.data import PromptDataset, PromptExample
from megatron_tlt.spec.engine import SamplingSettings


@dataclasses.dataclass(frozen=True)
class Task:
    tokenizer: Tokenizer
    arch: PolicyArchitecture
    dataset: PromptDataset
    held_out: list[PromptExample]
    """Prompts never trained on, for evaluation (a prompt file's: ``data.held_out_path``'s, else none)."""

    def __post_init__(self):
        if self.tokenizer.eos_id is None:
            raise ValueError(f"tokenizer {self.tokenizer.directory} has no EOS token: responses would never end")


class TaskSource(Protocol):
    """Where a run's task and initial policy come from. ``architecture`` runs in the parent process (no
    Megatron, no vLLM); the rest on every rank."""

    def architecture(self) -> PolicyArchitecture:
        """The policy's architecture, for the layout checks before any rank starts."""
        ...

    def load_task(self) -> Task:
        """The tokenizer, architecture, training prompts and held-out prompts."""
        ...

    def initial_policy_dir(self, task: Task, *, show_progress: bool) -> Path | None:
        """The policy checkpoint RL starts from, made now if need be (collective); None where the policy
        loads from ``model.hf_dir`` instead (``policy_source.load_policy``)."""
        ...

    def install_shipped(self, entry: Path) -> bool:
        """Install the packaged copy of the cache entry ``entry`` (e.g. a cold-start drafter); False where
        none is shipped."""
        ...


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
                      seed: int | None, logprobs: bool = False) -> SamplingSettings:
    """The run's rollout sampling at ``temperature`` (greedy ignores top-p), ending at EOS; ``logprobs``: with each
    sampled token's log-prob (the RL rollout's, for the agreement check)."""
    r = config.rollout
    return SamplingSettings(n=n, temperature=temperature, top_p=r.top_p if temperature > 0 else 1.0,
                            max_tokens=r.max_response_tokens, stop_token_ids=[tokenizer.eos_id], seed=seed,
                            logprobs=logprobs)
