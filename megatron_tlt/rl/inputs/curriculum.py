"""An easy-first curriculum: the first RL steps draw only short prompts, then the whole prompt set.

Curricula order prompts by difficulty, and the prompt's length is the one measure of it every dataset has (on the
built-in task a problem's prompt grows ~2 tokens per operation, and its worked solution ~8 tokens per operation).
``data.curriculum_steps`` steps draw from the prompts of at most ``data.curriculum_max_prompt_tokens`` tokens; the
steps after draw from every prompt. Such a switch moves what the policy writes far in one step: the drafter's
cold start, made on the prompts the run starts with, has never seen the long responses that come after it, and
goes stale (TLT's drift case; ``bench/tlt_end_to_end.py --curriculum``).
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_tlt.rl.inputs.data import PromptExample
from megatron_tlt.rl.inputs.sampler import PromptSampler


def easy_positions(examples: Sequence[PromptExample], max_prompt_tokens: int) -> list[int]:
    """Positions of the prompts of at most ``max_prompt_tokens`` tokens (BOS included), in dataset order."""
    return [i for i, example in enumerate(examples) if len(example.prompt_ids) <= max_prompt_tokens]


class CurriculumSampler:
    """``PromptSampler``'s batches, from the easy prompts for the first ``easy_steps`` steps, then from all.

    Each stage has its own seeded sampler, so the full stage draws what a run without a curriculum draws from its
    first step on; the state holds both samplers' and the steps drawn, so a resumed run continues in its stage."""

    def __init__(self, num_examples: int, easy: list[int], easy_steps: int, *, batch_prompts: int, dp_rank: int,
                 dp_size: int, seed: int):
        if easy_steps < 1:
            raise ValueError(f"data.curriculum_steps must be >= 1 for a curriculum, got {easy_steps}")
        if len(easy) < batch_prompts:
            raise ValueError(
                f"data.curriculum_max_prompt_tokens leaves {len(easy)} prompts for the curriculum's first steps, "
                f"fewer than one step takes (trainer.prompts_per_step={batch_prompts}): raise "
                "data.curriculum_max_prompt_tokens or lower trainer.prompts_per_step")
        self.easy = list(easy)
        self.easy_steps = easy_steps
        self.easy_sampler = PromptSampler(len(self.easy), batch_prompts=batch_prompts, dp_rank=dp_rank,
                                          dp_size=dp_size, seed=seed)
        self.full_sampler = PromptSampler(num_examples, batch_prompts=batch_prompts, dp_rank=dp_rank,
                                          dp_size=dp_size, seed=seed)
        self.steps_drawn = 0

    @property
    def in_easy_stage(self) -> bool:
        """Whether the next batch comes from the easy prompts."""
        return self.steps_drawn < self.easy_steps

    def __iter__(self) -> CurriculumSampler:
        return self

    def __next__(self) -> list[int]:
        easy = self.in_easy_stage
        self.steps_drawn += 1
        if easy:
            return [self.easy[i] for i in next(self.easy_sampler)]
        return next(self.full_sampler)

    def state_dict(self) -> dict:
        return {"curriculum_easy": self.easy_sampler.state_dict(), "curriculum_full": self.full_sampler.state_dict(),
                "curriculum_steps_drawn": self.steps_drawn, "curriculum_easy_steps": self.easy_steps,
                "curriculum_easy_prompts": len(self.easy)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position; refuses a state saved without this curriculum, or with another."""
        if "curriculum_easy" not in state:
            raise ValueError("cannot resume: the checkpoint's run had no curriculum (data.curriculum_steps=0) and "
                             "this one has; resume with the same data settings")
        saved = (state["curriculum_easy_steps"], state["curriculum_easy_prompts"])
        if saved != (self.easy_steps, len(self.easy)):
            raise ValueError(
                f"cannot resume: the checkpoint's curriculum ran {saved[0]} steps on {saved[1]} easy prompts, this "
                f"one {self.easy_steps} steps on {len(self.easy)} (resume with the same data.curriculum_steps and "
                "data.curriculum_max_prompt_tokens)")
        self.easy_sampler.load_state_dict(state["curriculum_easy"])
        self.full_sampler.load_state_dict(state["curriculum_full"])
        self.steps_drawn = int(state["curriculum_steps_drawn"])


def prompt_sampler(examples: Sequence[PromptExample], *, curriculum_steps: int, curriculum_max_prompt_tokens: int,
                   batch_prompts: int, dp_rank: int, dp_size: int, seed: int) -> PromptSampler | CurriculumSampler:
    """The run's sampler: a plain ``PromptSampler`` without a curriculum (its state as before curricula existed)."""
    if not curriculum_steps:
        return PromptSampler(len(examples), batch_prompts=batch_prompts, dp_rank=dp_rank, dp_size=dp_size, seed=seed)
    return CurriculumSampler(len(examples), easy_positions(examples, curriculum_max_prompt_tokens), curriculum_steps,
                             batch_prompts=batch_prompts, dp_rank=dp_rank, dp_size=dp_size, seed=seed)
