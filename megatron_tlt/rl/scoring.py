"""Responses scored into samples (inline, or from the reward pool that scored them during the rollout), and the
held-out accuracy a run reports before RL and every ``trainer.eval_every`` steps."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron_tlt.config import DataConfig
from megatron_tlt.rl.inputs.data import PromptExample
from megatron_tlt.rl.rewards.functions import get_reward_fn
from megatron_tlt.rl.rewards.pool import RankRewardPool, StreamedScores

EVAL_SAMPLES_PER_PROMPT = 4
_EVAL_SEED_STEP = 1 << 30  # a step index no RL step reaches: evaluation samples never repeat a rollout's


@dataclasses.dataclass
class Sample:
    """One response with its score (travels between ranks as a plain object)."""

    prompt_index: int
    """Position of its prompt in this DP rank's batch: the GRPO group it belongs to."""
    sample_index: int
    prompt_ids: tuple[int, ...]
    response_ids: list[int]
    finish_reason: str
    reward: float
    rollout_logprobs: list[float] | None = None
    """log p of each response token under the engine that sampled it (``RolloutResult.logprobs``)."""

    @property
    def correct(self) -> bool:
        return self.reward >= 1.0


def rollout_seed(base: int, step: int, rank: int) -> int:
    # Independent, reproducible streams per (step, rank): a resumed run draws the same samples.
    return int(np.random.SeedSequence([base, step, rank]).generate_state(1)[0] % (2**31 - 1))


class ResponseScorer:
    """Scores an engine's responses with ``data.reward``: here, or through this rank's reward pool."""

    def __init__(self, data: DataConfig, tokenizer, reward_pool: RankRewardPool | None):
        self.reward_fn = get_reward_fn(data.reward)
        self.tokenizer, self.reward_pool = tokenizer, reward_pool  # a pool exactly where data.reward_workers

    def _decode(self, response: list[int]) -> str:
        return self.tokenizer.decode(response, skip_special_tokens=True)

    def stream(self, examples: list[PromptExample], label: str) -> StreamedScores | None:
        """With the reward pool, on an engine's leader: what hands each prompt's responses to it as the engine
        finishes them."""
        if self.reward_pool is None:
            return None
        return self.reward_pool.stream(self._decode, [e.ground_truth for e in examples], label=label)

    def score(self, examples: list[PromptExample], token_ids: list[list[list[int]]],
              finish_reasons: list[list[str]], first_prompt_index: int, stride: int,
              streamed: StreamedScores | None = None,
              logprobs: list[list[list[float]]] | None = None) -> list[Sample]:
        """The samples with their rewards: from ``streamed`` (the pool) or scored here; none on an engine's
        non-leading ranks when a pool scores (their leader's pool has them)."""
        if self.reward_pool is not None and streamed is None:
            return []
        pooled = streamed.scores() if streamed is not None else None
        samples = []
        for k, (example, responses, reasons) in enumerate(zip(examples, token_ids, finish_reasons)):
            for j, (response, reason) in enumerate(zip(responses, reasons)):
                if pooled is not None:
                    reward = pooled[k][j].reward
                else:
                    reward = float(self.reward_fn(self._decode(response), example.ground_truth))
                samples.append(Sample(prompt_index=first_prompt_index + k * stride, sample_index=j,
                                      prompt_ids=example.prompt_ids, response_ids=list(response),
                                      finish_reason=reason, reward=reward,
                                      rollout_logprobs=logprobs[k][j] if logprobs is not None else None))
        return samples


def held_out_accuracy(held_out: Sequence[PromptExample], engine, session, placement, scorer: ResponseScorer, *,
                      temperature: float, seed: int) -> dict[str, float] | None:
    """Held-out accuracy, greedy and sampled (collective; every rank gets the numbers)."""
    if not held_out:
        return None
    mine = placement.world_share(held_out)
    counts = torch.zeros(3, dtype=torch.float64)  # on the CPU on purpose: reduced over gloo
    if mine:
        prompts = [e.prompt_ids for e in mine]
        greedy_scores = scorer.stream(mine, "held-out greedy prompt")
        greedy = engine.generate(prompts, session.sampling(n=1, temperature=0.0, seed=None),
                                 on_finished=greedy_scores.on_finished if greedy_scores else None)
        sampled_scores = scorer.stream(mine, "held-out sampled prompt")
        sampled = engine.generate(prompts, session.sampling(
            n=EVAL_SAMPLES_PER_PROMPT, temperature=temperature,
            seed=rollout_seed(seed, _EVAL_SEED_STEP, placement.leader_rank)),
            on_finished=sampled_scores.on_finished if sampled_scores else None)
        counts[0] = sum(s.correct for s in scorer.score(mine, greedy.token_ids, greedy.finish_reasons, 0, 1,
                                                        greedy_scores))
        counts[1] = sum(s.correct for s in scorer.score(mine, sampled.token_ids, sampled.finish_reasons, 0, 1,
                                                        sampled_scores))
        counts[2] = len(mine)
    if not placement.is_leader:  # the engine's other ranks saw the same answers
        counts.zero_()
    dist.all_reduce(counts)
    return {"eval/greedy_accuracy": counts[0].item() / counts[2].item(),
            "eval/sampled_accuracy": counts[1].item() / (EVAL_SAMPLES_PER_PROMPT * counts[2].item())}
