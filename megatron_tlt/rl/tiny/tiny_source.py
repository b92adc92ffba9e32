"""The tiny default as a run's task source (``rl/inputs/task.py``): the synthetic task's tokenizer and prompts
(``rl/tiny/tiny_default.py``), and a policy warmed up on it (``rl/tiny/warmup.py``), installed from the package
(``rl/tiny/shipped_start.py``) or made and cached on first use.

The only module outside the tiny default's own that imports them (tests/unit/test_layering.py checks it).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from megatron_tlt.config import TLTConfig
from megatron_tlt.formats import policy_meta
from megatron_tlt.formats.architecture import PolicyArchitecture
from megatron_tlt.formats.tokenizer import Tokenizer
from megatron_tlt.rl.inputs.task import Task
from megatron_tlt.rl.run.artifact_cache import cache_key, cache_root, warmup_recipe
from megatron_tlt.rl.tiny import shipped_start, tiny_default

logger = logging.getLogger(__name__)


def warmed_up_dir(config: TLTConfig, tokenizer: Tokenizer) -> Path:
    """The cache entry of the warmed-up tiny policy for this config (it may not exist yet)."""
    shape = tiny_default.TaskShape.of(config)
    # The default task shape keeps the key it had before the shape was configurable: cached entries stay valid.
    task = {} if shape == tiny_default.TaskShape() else dict(task=dataclasses.asdict(shape))
    key = cache_key(kind="warmup", policy=tiny_default.policy_config(config), vocab=tokenizer.vocab_size,
                    warmup=warmup_recipe(config), seed=config.trainer.seed, dtype=config.model.dtype,
                    attention=config.model.attention, **task)
    return cache_root(config.warmup.cache_dir) / f"policy-{key}"


class TinyDefaultSource:
    """The task of a config without ``model.hf_dir``."""

    def __init__(self, config: TLTConfig):
        self.config = config
        self.cache = cache_root(config.warmup.cache_dir)

    def architecture(self) -> PolicyArchitecture:
        # in the parent process this makes the tokenizer once, before every rank loads it
        return tiny_default.policy_architecture(self.config, tiny_default.load_task_tokenizer(self.cache))

    def load_task(self) -> Task:
        config = self.config
        tokenizer = tiny_default.load_task_tokenizer(self.cache)
        shape = tiny_default.TaskShape.of(config)
        held_out = (tiny_default.held_out_prompts(tokenizer, config.data.held_out_prompts, config.warmup.corpus_size,
                                                  shape) if config.data.held_out_prompts else [])
        return Task(tokenizer, tiny_default.policy_architecture(config, tokenizer),
                    tiny_default.rl_prompts(tokenizer, config.data.synthetic_prompts, shape), list(held_out))

    def initial_policy_dir(self, task: Task, *, show_progress: bool) -> Path:
        """The warmed-up policy checkpoint: cached, else installed from the package, else made now."""
        final = warmed_up_dir(self.config, task.tokenizer)
        if not (final / policy_meta.META_FILE).is_file():
            if not self.install_shipped(final):
                from megatron_tlt.rl.tiny.warmup import warm_up_tiny_policy

                warm_up_tiny_policy(self.config, task.tokenizer, task.arch, final, show_progress=show_progress)
        elif show_progress:
            logger.info("using the cached warmed-up policy %s", final)
        return final

    def install_shipped(self, entry: Path) -> bool:
        return self.config.warmup.use_shipped and shipped_start.install(entry)
