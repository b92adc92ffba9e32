"""Phase 2, reward: the responses scored where they were generated, shared, and turned into advantages.

Rewards are scored inline after the rollout, or collected from the reward pool that scored them while the
rollout's tail still generated (``rl/rewards/pool.py``). The ranks of one model-parallel group then hold every
sample of their DP rank in group order; only an engine's leader reports its samples, so none counts twice.
Advantages are group-relative over the n samples of a prompt; a group never spans DP ranks.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_tlt.config import AlgorithmConfig
from megatron_tlt.parallel import ParallelLayout
from megatron_tlt.rl.advantages import equal_reward_group_mask, get_advantage_fn
from megatron_tlt.rl.phases.rollout import RolloutOutcome
from megatron_tlt.rl.scoring import ResponseScorer, Sample
from megatron_tlt.timeline.spans import RankTimeline


@dataclasses.dataclass
class ScoredStep:
    own: list[Sample]
    """The samples this rank reports (an engine's leader: its engine's; the other ranks: none)."""
    samples: list[Sample]
    """Every sample of this DP rank, in group order."""
    sequences: list[list[int]]
    """Prompt + response token ids of each sample."""
    advantages: list[float]
    """Per sample; NaN marks the groups the equal-reward filter leaves out of the update."""
    dropped_groups: int


class RewardPhase:
    def __init__(self, *, scorer: ResponseScorer, placement, layout: ParallelLayout, samples_per_prompt: int,
                 algorithm: AlgorithmConfig):
        self.scorer, self.placement, self.mp_group = scorer, placement, layout.model_parallel_group
        self.mp_size = dist.get_world_size(self.mp_group)
        self.samples_per_prompt, self.algorithm = samples_per_prompt, algorithm
        self.advantage_fn = get_advantage_fn(algorithm.advantage)

    def run(self, rollout: RolloutOutcome, timeline: RankTimeline) -> ScoredStep:
        p, result = self.placement, rollout.result
        with timeline.phase("reward"):
            own = self.scorer.score(rollout.prompts, result.token_ids, result.finish_reasons, p.index_in_replica,
                                    p.engines_per_replica, rollout.streamed, result.logprobs) if rollout.prompts else []
            if self.mp_size > 1:
                gathered: list[list[Sample]] = [None] * self.mp_size
                dist.all_gather_object(gathered, own, group=self.mp_group)
                samples = [s for part in p.leaders_only(gathered) for s in part]
            else:
                samples = list(own)
            samples.sort(key=lambda s: (s.prompt_index, s.sample_index))
            advantages, dropped = self._advantages(samples)
        return ScoredStep(own=own if p.is_leader else [], samples=samples,
                          sequences=[list(s.prompt_ids) + s.response_ids for s in samples], advantages=advantages,
                          dropped_groups=dropped)

    def _advantages(self, samples: list[Sample]) -> tuple[list[float], int]:
        rewards_g = torch.tensor([s.reward for s in samples], dtype=torch.float32).view(-1, self.samples_per_prompt)
        advantages_g = self.advantage_fn(rewards_g)
        dropped = 0
        if self.algorithm.filter_equal_reward_groups:
            equal = equal_reward_group_mask(rewards_g)
            advantages_g[equal] = float("nan")  # marks samples to leave out of the update
            dropped = int(equal.sum())
        return advantages_g.view(-1).tolist(), dropped
