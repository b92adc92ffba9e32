"""A user's model and data as a run's task source (``rl/inputs/task.py``): the HF policy directory
``model.hf_dir``, its tokenizer, the prompt file ``data.path`` and the held-out one ``data.held_out_path``. Nothing
is made or cached here: RL starts from the HF weights themselves (``policy_source.load_policy``)."""

from __future__ import annotations

import logging
from pathlib import Path

from megatron_tlt.config import TLTConfig
from megatron_tlt.formats.architecture import PolicyArchitecture, load_architecture
from megatron_tlt.formats.tokenizer import load_tokenizer
from megatron_tlt.rl.inputs.data import PromptDataConfig, PromptDataset, PromptExample, load_prompt_dataset
from megatron_tlt.rl.inputs.task import Task

logger = logging.getLogger(__name__)


class PretrainedSource:
    """The task of a config with ``model.hf_dir`` set."""

    def __init__(self, config: TLTConfig):
        self.config = config
        self.hf_dir = config.model.hf_dir

    def architecture(self) -> PolicyArchitecture:
        return load_architecture(self.hf_dir)

    def load_task(self) -> Task:
        if self.config.data.path is None:
            raise ValueError("model.hf_dir needs a prompt file in data.path")
        tokenizer = load_tokenizer(self.hf_dir)
        reading = PromptDataConfig.from_config(self.config.data)
        dataset = load_prompt_dataset(self.config.data.path, tokenizer, reading)
        return Task(tokenizer, self.architecture(), dataset, self._held_out(tokenizer, reading, dataset))

    def _held_out(self, tokenizer, reading: PromptDataConfig, dataset: PromptDataset) -> list[PromptExample]:
        """``data.held_out_path``'s prompts (none without it); a prompt that is also a training prompt is
        counted and said, as it would lift the held-out accuracy for no reason."""
        if self.config.data.held_out_path is None:
            return []
        held_out = list(load_prompt_dataset(self.config.data.held_out_path, tokenizer, reading).examples)
        trained_on = {tuple(e.prompt_ids) for e in dataset.examples}
        shared = sum(tuple(e.prompt_ids) in trained_on for e in held_out)
        if shared:
            logger.warning("data.held_out_path: %d of its %d prompts are also in data.path, so the held-out "
                           "accuracy partly measures prompts the run trains on", shared, len(held_out))
        return held_out

    def initial_policy_dir(self, task: Task, *, show_progress: bool) -> Path | None:
        return None  # loaded from model.hf_dir, converted as it loads

    def install_shipped(self, entry: Path) -> bool:
        return False  # the package ships the tiny default's entries only
