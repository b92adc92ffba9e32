"""Which prompts each data-parallel rank takes at each step: a deterministic, resumable sampler.

Each epoch is a seeded shuffle of the dataset cut into global batches; rank r takes the r-th equal
slice of each. The position (epoch, step) is the sampler's whole state, so a resumed run continues
with exactly the batches the interrupted one would have drawn.
"""

from __future__ import annotations

import numpy as np

_SETTINGS = {"num_examples": "usable prompts", "batch_prompts": "trainer.prompts_per_step", "seed": "trainer.seed",
             "shuffle": "shuffle"}
"""What a user set for each value of the sampler's state, as its errors name it."""


class PromptSampler:
    """Per-step batches of dataset positions for one DP rank; an iterator that never ends.

    Each epoch is a permutation of ``range(num_examples)`` (seeded by ``(seed, epoch)``; identity order
    when ``shuffle`` is off) cut into ``num_examples // batch_prompts`` global batches of ``batch_prompts``
    prompts; DP rank r takes the r-th of ``dp_size`` equal contiguous slices of each. So within an epoch
    every position is used at most once across all ranks, and exactly once when ``batch_prompts`` divides
    ``num_examples``; the remainder (under ``batch_prompts`` positions) is left out of that epoch only,
    and a different remainder is left out each shuffled epoch.

    The position (epoch, step) is the next batch to hand out; ``state_dict``/``load_state_dict`` save and
    restore it. The global batches do not depend on ``dp_size``, so a run may resume on a different number
    of DP ranks and still see the same prompts per step.

    Its errors name the settings the RL trainer fills it from (``_SETTINGS``): ``batch_prompts`` is
    ``trainer.prompts_per_step``, ``dp_size`` is ``parallel.data_parallel_size`` and ``seed`` is ``trainer.seed``.
    """

    def __init__(
        self, num_examples: int, *, batch_prompts: int, dp_rank: int, dp_size: int, seed: int, shuffle: bool = True
    ):
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size): got dp_rank={dp_rank}, dp_size={dp_size}")
        if batch_prompts < 1 or batch_prompts % dp_size:
            raise ValueError(
                f"trainer.prompts_per_step ({batch_prompts}) must be a positive multiple of "
                f"parallel.data_parallel_size ({dp_size}): every DP rank gets the same number of prompts per step"
            )
        if num_examples < batch_prompts:
            raise ValueError(
                f"the dataset has {num_examples} usable prompts, fewer than one step takes "
                f"(trainer.prompts_per_step={batch_prompts}): set trainer.prompts_per_step to at most "
                f"{num_examples} or add data"
            )
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.num_examples = num_examples
        self.batch_prompts = batch_prompts
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.step = 0
        self._order_epoch: int | None = None
        self._order: np.ndarray | None = None

    @property
    def steps_per_epoch(self) -> int:
        return self.num_examples // self.batch_prompts

    @property
    def prompts_per_rank(self) -> int:
        return self.batch_prompts // self.dp_size

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
            else:
                self._order = np.arange(self.num_examples)
            self._order_epoch = epoch
        return self._order

    def __iter__(self) -> PromptSampler:
        return self

    def __next__(self) -> list[int]:
        """This rank's positions for the current step; then advance, rolling over into the next epoch."""
        start = self.step * self.batch_prompts + self.dp_rank * self.prompts_per_rank
        batch = self._epoch_order(self.epoch)[start : start + self.prompts_per_rank].tolist()
        self.step += 1
        if self.step == self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict[str, int | bool]:
        """The position plus what it is only meaningful with (data size, batch, seed, shuffle)."""
        return {
            "epoch": self.epoch,
            "step": self.step,
            "num_examples": self.num_examples,
            "batch_prompts": self.batch_prompts,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position. Raises ValueError when the state was saved for other data,
        batch size, seed or shuffling, since the same position would then name different prompts."""
        missing = [key for key in self.state_dict() if key not in state]
        if missing:
            raise ValueError(f"sampler state lacks {', '.join(missing)}: not a PromptSampler state_dict")
        mismatched = [
            f"{_SETTINGS[key]} {state[key]!r} at the checkpoint, {getattr(self, key)!r} now"
            for key in ("num_examples", "batch_prompts", "seed", "shuffle")
            if state[key] != getattr(self, key)
        ]
        if mismatched:
            raise ValueError(
                "cannot resume the prompt sampler: " + "; ".join(mismatched)
                + " (resume with the same data, trainer.prompts_per_step and trainer.seed)"
            )
        epoch, step = int(state["epoch"]), int(state["step"])
        if epoch < 0 or not 0 <= step < self.steps_per_epoch:
            raise ValueError(f"sampler state out of range: epoch={epoch}, step={step} (steps_per_epoch "
                             f"{self.steps_per_epoch})")
        self.epoch, self.step = epoch, step
