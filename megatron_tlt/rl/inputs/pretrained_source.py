"""A user's model and data as a run's task source (``rl/inputs/task.py``): the HF policy directory
``model.hf_dir``, its tokenizer, and the prompt file ``data.path``. Nothing is made or cached here: RL
starts from the HF weights themselves (``policy_source.load_policy``)."""

from __future__ import annotations

from pathlib import Path

from megatron_tlt.config import TLTConfig
from megatron_tlt.formats.architecture import PolicyArchitecture, load_architecture
from megatron_tlt.formats.tokenizer import load_tokenizer
from megatron_tlt.rl.inputs.data import PromptDataConfig, load_prompt_dataset
from megatron_tlt.rl.inputs.task import Task


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
        dataset = load_prompt_dataset(self.config.data.path, tokenizer, PromptDataConfig.from_config(self.config.data))
        return Task(tokenizer, self.architecture(), dataset, [])

    def initial_policy_dir(self, task: Task, *, show_progress: bool) -> Path | None:
        return None  # loaded from model.hf_dir, converted as it loads

    def install_shipped(self, entry: Path) -> bool:
        return False  # the package ships the tiny default's entries only
