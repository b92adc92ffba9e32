"""Which task source a run has (``rl/inputs/task.py``'s ``TaskSource``): the only place that asks whether the
config names a model of its own. Above both kinds: the tiny default's (``rl/tiny/``) and yours (``rl/inputs/``)."""

from __future__ import annotations

from megatron_tlt.config import TLTConfig
from megatron_tlt.rl.inputs.pretrained_source import PretrainedSource
from megatron_tlt.rl.inputs.task import TaskSource
from megatron_tlt.rl.tiny.tiny_source import TinyDefaultSource


def task_source(config: TLTConfig) -> TaskSource:
    """The tiny default where ``model.hf_dir`` is None, else the user's model and prompt file."""
    if config.model.hf_dir is None:
        return TinyDefaultSource(config)
    return PretrainedSource(config)
