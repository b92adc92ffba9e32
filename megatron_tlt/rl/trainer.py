"""The RL loop on every rank: rollout -> reward -> log-prob -> update -> sync (DESIGN.md section 1).

Ranks and their work:
  * each data-parallel (DP) rank owns a slice of every step's prompts; the vLLM engines of its
    model-parallel group share them out for rollout, then exchange the results. An engine spans the
    ranks of (a divisor of) the policy's tensor-parallel group (``rl/engine_placement.py``), so with
    PP > 1 each pipeline stage's TP group runs an engine of the whole policy;
  * rewards are scored where a response was generated; advantages are group-relative over the n
    samples of a prompt (a group never spans DP ranks);
  * the log-prob pass and the update run through Megatron's schedules on the model-parallel group,
    gradients are all-reduced over DP, and the token mean covers the global batch (``rl/update.py``);
  * the sync streams the new weights into every engine (``rl/weight_sync.py``).
Rollout ends at a barrier over all ranks, so each rank's idle time in the long tail is measured
exactly; every phase is timed per rank (``rl/timeline.py``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_tlt import config as config_mod, mcore
from megatron_tlt.config import TLTConfig
from megatron_tlt.device import compute_device, module_device
from megatron_tlt.drafter import checkpoint_paths as drafter_checkpoint_paths
from megatron_tlt.drafter import checkpointer as drafter_checkpoints, store as drafter_store
from megatron_tlt.drafter.spot import DeviceIdleProbe, SpotTrainer
from megatron_tlt.drafter.precision import resolve_precision
from megatron_tlt.drafter.trainer import POLICY_HEAD_NAMES, DrafterTrainer, DrafterTrainingSettings
from megatron_tlt.rl import checkpoint, checkpoint_paths, policy_source, run_dir as run_files
from megatron_tlt.rl.actor import compute_logprobs, features_on_every_stage
from megatron_tlt.rl.advantages import equal_reward_group_mask, get_advantage_fn
from megatron_tlt.rl.data import PromptExample
from megatron_tlt.rl.engine_placement import engine_placement
from megatron_tlt.rl.rewards import get_reward_fn
from megatron_tlt.rl.sampler import PromptSampler
from megatron_tlt.rl.task import engine_config_for, load_task, sampling_settings
from megatron_tlt.timeline import BUSY, IDLE, PHASES, TRAINING, RankTimeline, rollout_idle_seconds, rollout_idle_shares
from megatron_tlt.rl.update import LossSettings, PolicySequence, policy_update_step
from megatron_tlt.rl.weight_sync import sync_policy_to_engine
from megatron_tlt.spec.engine import RolloutEngine, SamplingSettings, SpeculativeSettings

logger = logging.getLogger(__name__)

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

    @property
    def correct(self) -> bool:
        return self.reward >= 1.0


def _rollout_seed(base: int, step: int, rank: int) -> int:
    # Independent, reproducible streams per (step, rank): a resumed run draws the same samples.
    return int(np.random.SeedSequence([base, step, rank]).generate_state(1)[0] % (2**31 - 1))


# bench/spot_overhead.py on 2 CPU cores: +7.8% critical path training all idle time, none measurable at 0.25
CPU_SPOT_DUTY_CYCLE = 0.25


class RLTrainer:
    """Built collectively on every rank; ``run()`` trains to ``trainer.steps``."""

    def __init__(self, config: TLTConfig, run_dir: Path, *, resume: bool):
        self.config, self.run_dir = config, run_dir
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dp_rank, self.dp_size = mcore.data_parallel_rank(), mcore.data_parallel_size()
        self.mp_group = mcore.model_parallel_group()
        self.mp_rank, self.mp_size = dist.get_rank(self.mp_group), dist.get_world_size(self.mp_group)
        self.is_reporter = self.rank == 0
        stage = mcore.stage_info()

        task = load_task(config)
        self.tokenizer, self.arch, self.dataset, self.held_out = task.tokenizer, task.arch, task.dataset, task.held_out
        self.arch.validate_layout(tensor_parallel_size=stage.tp_size, pipeline_parallel_size=stage.pp_size)
        self.reward_fn = get_reward_fn(config.data.reward)
        self.advantage_fn = get_advantage_fn(config.algorithm.advantage)

        self.initial_source = policy_source.initial_policy_dir(config, self.tokenizer, self.arch,
                                                               show_progress=self.is_reporter)
        ckpt = checkpoint_paths.latest_checkpoint(run_dir) if resume else None
        if resume and ckpt is None:
            raise checkpoint.CheckpointError(f"{run_dir}: no complete checkpoint to resume from")
        source = ckpt / checkpoint_paths.POLICY_SUBDIR if ckpt else self.initial_source
        self.model = mcore.wrap_ddp(policy_source.load_policy(config, self.arch, source),
                                    distributed_optimizer=config.optimizer.distributed)
        # The checkpoint's vocabulary padding, which a policy saved at another TP keeps (e.g. 512 rows
        # from TP=2 loaded at TP=1, where this layout alone would pad to 384): the sync's shapes follow it.
        self.padded_vocab = mcore.unwrap(self.model).vocab_size
        opt = config.optimizer
        self.optimizer = mcore.build_optimizer(self.model, lr=opt.lr, weight_decay=opt.weight_decay,
                                               clip_grad=opt.clip_grad, adam_beta1=opt.adam_beta1,
                                               adam_beta2=opt.adam_beta2, min_lr=opt.min_lr)
        self.lr_schedule = mcore.build_lr_scheduler(
            self.optimizer, lr=opt.lr, min_lr=opt.min_lr, warmup_steps=opt.lr_warmup_steps,
            total_steps=config.trainer.steps * config.trainer.updates_per_step, style=opt.lr_decay_style)
        if ckpt is None and config.warmup.continue_optimizer:
            self._continue_warmup_optimizer()
        self.reference = None
        if config.algorithm.kl_coef != 0.0:  # frozen copy of the starting policy
            self.reference = policy_source.load_policy(config, self.arch, self.initial_source)
            self.reference.requires_grad_(False)

        self.sampler = PromptSampler(len(self.dataset), batch_prompts=config.trainer.prompts_per_step,
                                     dp_rank=self.dp_rank, dp_size=self.dp_size, seed=config.trainer.seed)
        self.start_step = 0
        state = None
        if ckpt is not None:
            state = checkpoint.load_checkpoint_state(ckpt, optimizer=self.optimizer)
            self.sampler.load_state_dict(state["sampler"])
            checkpoint.set_rng_state(state["rng"])
            self.start_step = checkpoint_paths.checkpoint_step(ckpt)
            self.lr_schedule.step(self.start_step * config.trainer.updates_per_step)  # a function of the step
            if self.is_reporter:
                logger.info("resuming %s from step %d (%s)", run_dir, self.start_step, ckpt)

        self._build_drafter()
        speculation = {}
        if config.drafter.speculative_tokens > 0:
            speculative = SpeculativeSettings(num_speculative_tokens=config.drafter.speculative_tokens,
                                              adaptive=config_mod.bandit_settings(config))
            speculation = dict(speculative=speculative, drafter=self.drafter_trainer.drafter.export_tensors())
        engine_config = engine_config_for(config, task)
        self.placement = engine_placement(engine_config.tensor_parallel_size)
        self.engine = RolloutEngine(self.arch, engine_config, workdir=run_dir / "engines", rank=self.rank, **speculation)
        if state is not None and state.get("bandit") is not None and config.speculation.adaptive:
            self.engine.load_bandit_state(state["bandit"])  # what it learned about depths goes on
            if self.is_reporter:
                logger.info("BEG-MAB state restored from %s", ckpt)
        self.feature_rows_captured = 0  # drafter features of the last log-prob pass (last stage)
        self.reporter = None
        if self.is_reporter:
            records = [r for r in run_files.read_summary(run_dir) if r["step"] <= self.start_step]
            run_files.truncate_timeline(run_dir, self.start_step)
            self.reporter = run_files.RunReporter(run_dir, total_steps=config.trainer.steps,
                                                  start_step=self.start_step, records=records)

    # ------------------------------------------------------------------ set-up helpers

    def _build_drafter(self) -> None:
        """The drafter replica of this rank (speculation or spot training on), and the spot trainer."""
        d = self.config.drafter
        self.drafter_trainer, self.spot, self.drafter_checkpointer = None, None, None
        self.drafter_tokens_total = 0
        self._spot_on = False  # whether the spot trainer works in the current step
        if d.speculative_tokens == 0 and not d.spot_training:
            return
        self.drafter_trainer = DrafterTrainer(self.arch, DrafterTrainingSettings(
            lr=d.lr, buffer_tokens=d.buffer_tokens, pack_tokens=d.pack_tokens, hidden_weight=d.hidden_weight,
            ce_weight=d.ce_weight, seed=self.config.trainer.seed,
            precision=resolve_precision(d.precision)))
        self._load_drafter()
        if d.spot_training:
            device = compute_device().index  # the CUDA device whose NVML utilisation to read; None on CPU
            self.drafter_checkpointer = drafter_checkpoints.AsyncDrafterCheckpointer(
                self.run_dir, self.arch, rank=self.rank, world=self.world, keep=self.config.trainer.keep_checkpoints)
            # no training while a checkpoint write still reads the drafter (it is not copied)
            self.spot = SpotTrainer(self.drafter_trainer.micro_step, DeviceIdleProbe(device),
                                    may_train=lambda: not self.drafter_checkpointer.writing(),
                                    duty_cycle=_spot_duty_cycle(self.config.drafter.spot_duty_cycle))

    def _load_drafter(self) -> None:
        """A resumed run continues its own drafter; a new one starts from ``drafter.init_dir`` if set."""
        found = None
        if self.start_step > 0 and self.config.drafter.spot_training:
            found = drafter_checkpoint_paths.drafter_checkpoint_for(self.run_dir, self.start_step)
            if found is None and self.is_reporter:
                logger.warning("%s: no drafter checkpoint at or before step %d; the drafter starts again from "
                               "its initial weights", self.run_dir, self.start_step)
        if found is not None:
            step, directory = found
            self.drafter_trainer.drafter.load_tensors(drafter_store.read_drafter_tensors(directory, self.arch))
            self.drafter_tokens_total = int(drafter_store.read_drafter_info(directory).get("tokens_trained", 0))
            with_adam = drafter_checkpoints.load_adam_state(self.run_dir, step, self.drafter_trainer.optimizer,
                                                            rank=self.rank, world=self.world)
            if self.is_reporter:
                logger.info("drafter resumed from %s (Adam state %s)", directory, "restored" if with_adam else "fresh")
        elif self.config.drafter.init_dir is not None:
            self.drafter_trainer.drafter.load_tensors(
                drafter_store.read_drafter_tensors(self.config.drafter.init_dir, self.arch))

    def _continue_warmup_optimizer(self) -> None:
        """Start RL from the warm-up's Adam state, at RL's learning rate.

        A fresh Adam's first steps are sign-like: every weight moves by ~lr however noisy its gradient,
        and RL gradients from a few hundred samples are mostly noise for most weights of a tiny policy.
        The warm-up's second moments make RL's steps proportional to the gradient instead.
        """
        source = self.initial_source
        if self.config.optimizer.distributed:  # the warm-up's Adam is not sharded; RL's is
            if self.is_reporter and source is not None:
                logger.info("optimizer.distributed: RL starts with a fresh Adam (the warm-up's is not sharded)")
            return
        if source is None or not checkpoint.has_optimizer_state(source):
            if self.is_reporter and source is not None:
                logger.info("%s holds no optimizer state for this layout: RL starts with a fresh Adam", source)
            return
        checkpoint.load_optimizer_state(source, self.optimizer)
        opt = self.config.optimizer
        for group in self.optimizer.param_groups:  # the loaded groups carry the warm-up's learning rates
            group["max_lr"], group["min_lr"] = opt.lr, opt.min_lr
            group["lr"] = self.lr_schedule.get_lr(group)

    def _sampling(self, *, n: int, temperature: float, seed: int | None) -> SamplingSettings:
        return sampling_settings(self.config, self.tokenizer, n=n, temperature=temperature, seed=seed)

    def _score(self, examples: list[PromptExample], token_ids: list[list[list[int]]],
               finish_reasons: list[list[str]], first_prompt_index: int, stride: int) -> list[Sample]:
        samples = []
        for k, (example, responses, reasons) in enumerate(zip(examples, token_ids, finish_reasons)):
            for j, (response, reason) in enumerate(zip(responses, reasons)):
                text = self.tokenizer.decode(response, skip_special_tokens=True)
                samples.append(Sample(prompt_index=first_prompt_index + k * stride, sample_index=j,
                                      prompt_ids=example.prompt_ids, response_ids=list(response),
                                      finish_reason=reason, reward=float(self.reward_fn(text, example.ground_truth))))
        return samples

    # ------------------------------------------------------------------ one step

    def _rollout(self, step: int, examples: list[PromptExample], timeline: RankTimeline):
        mine = self.placement.replica_share(examples)  # this engine's share of its DP rank's prompts
        n = self.config.rollout.samples_per_prompt
        start = time.time()
        result = self.engine.generate(  # the ranks of one engine sample with one seed: the same responses
            [e.prompt_ids for e in mine],
            self._sampling(n=n, temperature=self.config.rollout.temperature,
                           seed=_rollout_seed(self.config.trainer.seed, step, self.placement.leader_rank)),
        ) if mine else None
        done = time.time()
        timeline.add("rollout", BUSY, start, done)
        self.spot_report, self.drafter_stats = None, None
        if self._spot_on:  # idle until the slowest rank is done: train the drafter meanwhile
            self.drafter_trainer.reset_phase_stats()
            self.spot_report = self.spot.wait_for_rollout_end(timeline)
            self.drafter_stats = self.drafter_trainer.phase_stats()
            with timeline.phase("sync"):  # one drafter version for every engine: the token-weighted mean
                self.drafter_checkpointer.wait()  # a write still reading the drafter (rollout shorter than it)
                self.drafter_tokens_total += self.drafter_trainer.average_replicas()
        else:
            dist.barrier()  # the phase ends when the slowest rank is done; until then this rank idles
            timeline.add("rollout", IDLE, done, time.time())
        return mine, result

    def _score_and_share(self, mine, result, timeline: RankTimeline) -> tuple[list[Sample], list[Sample]]:
        """Score this engine's responses; return (the samples this rank reports, all samples of this DP
        rank in group order). Only an engine's leader reports its samples, so none counts twice."""
        p = self.placement
        with timeline.phase("reward"):
            own = self._score(mine, result.token_ids, result.finish_reasons, p.index_in_replica,
                              p.engines_per_replica) if mine else []
            if self.mp_size > 1:
                gathered: list[list[Sample]] = [None] * self.mp_size
                dist.all_gather_object(gathered, own, group=self.mp_group)
                everything = [s for part in p.leaders_only(gathered) for s in part]
            else:
                everything = list(own)
            everything.sort(key=lambda s: (s.prompt_index, s.sample_index))
        return (own if p.is_leader else []), everything

    def _advantages(self, samples: list[Sample]) -> tuple[list[float], int]:
        """Advantages per sample (same order) and the number of groups dropped by the equal-reward filter."""
        n = self.config.rollout.samples_per_prompt
        rewards_g = torch.tensor([s.reward for s in samples], dtype=torch.float32).view(-1, n)
        advantages_g = self.advantage_fn(rewards_g)
        dropped = 0
        if self.config.algorithm.filter_equal_reward_groups:
            equal = equal_reward_group_mask(rewards_g)
            advantages_g[equal] = float("nan")  # marks samples to leave out of the update
            dropped = int(equal.sum())
        return advantages_g.view(-1).tolist(), dropped

    def _logprob_pass(self, sequences: list[list[int]], timeline: RankTimeline):
        t = self.config.trainer
        with timeline.phase("logprob"):
            # features are cut to what the drafter buffer keeps: a step's rollouts can be far larger
            result = compute_logprobs(self.model, sequences, vocab_size=self.arch.vocab_size,
                                      micro_batch_size=t.micro_batch_size, pad_id=self.tokenizer.pad_id,
                                      capture_hidden=t.capture_hidden_states or self._spot_on,
                                      max_feature_rows=self.config.drafter.buffer_tokens)
            ref = None
            if self.reference is not None:
                ref = compute_logprobs(self.reference, sequences, vocab_size=self.arch.vocab_size,
                                       micro_batch_size=t.micro_batch_size, pad_id=self.tokenizer.pad_id).token_logprobs
            self.feature_rows_captured = sum(result.feature_rows) if result.features is not None else 0
            if self._spot_on:  # every pipeline stage's idle ranks train: the last stage shares its features
                kept, features = features_on_every_stage(self.model, sequences, result)
                if features:
                    self.drafter_trainer.add_sequences(kept, features)
        return result.token_logprobs, ref

    def _update(self, samples: list[Sample], token_ids: list[list[int]], advantages: list[float], old, ref,
                timeline: RankTimeline) -> dict:
        a, t = self.config.algorithm, self.config.trainer
        settings = LossSettings(clip_low=a.clip_low, clip_high=a.clip_high, aggregation=a.loss_aggregation,
                                kl_coef=a.kl_coef)
        device = module_device(self.model)  # where the log-prob pass left ``old`` and ``ref``
        sequences = []
        for i, (sample, ids, advantage) in enumerate(zip(samples, token_ids, advantages)):
            if advantage != advantage:  # NaN: its group was filtered out
                continue
            # Only the last pipeline stage computes the loss; earlier stages carry placeholders.
            placeholder = torch.zeros(len(ids) - 1, device=device)
            sequences.append((i, PolicySequence(
                token_ids=ids, prompt_len=len(sample.prompt_ids),
                old_logprobs=old[i] if old else placeholder, advantage=advantage,
                ref_logprobs=(ref[i] if ref else placeholder) if self.reference is not None else None)))
        metrics: dict[str, list[float]] = {}
        with timeline.phase("update"):
            for u in range(t.updates_per_step):  # mini-batches interleave short and long sequences
                mini = [seq for i, seq in sequences if i % t.updates_per_step == u]
                # Advanced before the step, so optimizer step k runs at the schedule's k-th value
                # (Megatron's scheduler starts at init_lr 0, which would waste the first step).
                self.lr_schedule.step(1)
                metrics.setdefault("lr", []).append(self.optimizer.param_groups[0]["lr"])
                step_metrics = policy_update_step(self.model, self.optimizer, mini, vocab_size=self.arch.vocab_size,
                                                  micro_batch_size=t.micro_batch_size, pad_id=self.tokenizer.pad_id,
                                                  settings=settings)
                for key, value in step_metrics.items():
                    metrics.setdefault(key, []).append(value)
        return {key: statistics.fmean(values) for key, values in metrics.items()}

    def _sync(self, timeline: RankTimeline) -> float:
        keep = POLICY_HEAD_NAMES if self.spot is not None else frozenset()
        with timeline.phase("sync"):
            stats = sync_policy_to_engine(self.model, self.arch, self.engine, padded_vocab_size=self.padded_vocab,
                                          keep=keep)
            if self.spot is not None:  # the drafter drafts with the policy's current embedding and LM head
                self.drafter_trainer.set_policy_heads(stats.kept)
            if self.engine.speculative is not None:  # the reload must not lose the drafter: push it after
                self.engine.load_drafter(self.drafter_trainer.drafter.export_tensors())
        return stats.gb_per_s

    def train_step(self, step: int) -> dict:
        """One RL step (collective); returns the summary record on rank 0, None elsewhere."""
        timeline = RankTimeline(self.rank)
        step_start = time.time()
        examples = self.dataset.gather(next(self.sampler))
        # Benchmarks may leave some steps without the spot trainer (drafter.spot_training_steps).
        self._spot_on = self.spot is not None and _spot_step_selected(self.config.drafter.spot_training_steps, step + 1)
        mine, result = self._rollout(step, examples, timeline)
        own, samples = self._score_and_share(mine, result, timeline)
        advantages, dropped_groups = self._advantages(samples)
        sequences = [list(s.prompt_ids) + s.response_ids for s in samples]
        # Colocated: the engine's KV cache and weights leave the GPU while Megatron trains, as tlt plan counts it.
        self.engine.release_memory()
        old, ref = self._logprob_pass(sequences, timeline)
        update_metrics = self._update(samples, sequences, advantages, old, ref, timeline)
        self.engine.resume_memory()
        sync_gb_s = self._sync(timeline)
        per_rank = {
            "timeline": timeline,
            "rewards": [s.reward for s in own],
            "correct": [s.correct for s in own],
            "lengths": [len(s.response_ids) for s in own],
            "truncated": [s.finish_reason == "length" for s in own],
            "dropped_groups": dropped_groups if self.mp_rank == 0 else 0,
            # an engine's figures, once: from its leader
            "spec": result.spec if result is not None and self.placement.is_leader else None,
            "step_depths": result.step_depths if result is not None and self.placement.is_leader else [],
            "bandit": self.engine.bandit_summary() if self.placement.is_leader else None,
            "drafter": self.drafter_stats,
            "spot": self.spot_report,
            # counted once per replica: the last stage's TP ranks hold the same features
            "hidden_tokens": self.feature_rows_captured if mcore.stage_info().tp_rank == 0 else 0,
        }
        gathered = [None] * self.world if self.is_reporter else None
        dist.gather_object(per_rank, gathered, dst=0)
        if not self.is_reporter:
            return None
        return self._record(step + 1, gathered, update_metrics, sync_gb_s, time.time() - step_start)

    def _record(self, step: int, per_rank: list[dict], update: dict, sync_gb_s: float, step_seconds: float) -> dict:
        rewards = [r for p in per_rank for r in p["rewards"]]
        lengths = [n for p in per_rank for n in p["lengths"]]
        timelines = [p["timeline"] for p in per_rank]
        shares = rollout_idle_shares(timelines)
        phase = {name: max(t.seconds(name) for t in timelines) for name in PHASES}
        record = {
            "step": step,
            "reward_mean": statistics.fmean(rewards),
            "accuracy": statistics.fmean(float(c) for p in per_rank for c in p["correct"]),
            "response_length_mean": statistics.fmean(lengths),
            "response_length_max": max(lengths),
            "truncated_share": statistics.fmean(float(c) for p in per_rank for c in p["truncated"]),
            "num_samples": len(rewards),
            "equal_reward_groups_dropped": sum(p["dropped_groups"] for p in per_rank),
            "rollout_seconds": phase["rollout"],
            "reward_seconds": phase["reward"],
            "logprob_seconds": phase["logprob"],
            "update_seconds": phase["update"],
            "sync_seconds": phase["sync"],
            "step_seconds": step_seconds,
            "rollout_busy_seconds": [t.seconds("rollout", BUSY) for t in timelines],
            "rollout_idle_seconds": [rollout_idle_seconds(t) for t in timelines],
            "rollout_training_seconds": [t.seconds("rollout", TRAINING) for t in timelines],
            "rollout_idle_share": shares,
            "rollout_idle_share_mean": statistics.fmean(shares),
            "sync_gb_per_s": sync_gb_s,
            "hidden_state_tokens_captured": sum(p["hidden_tokens"] for p in per_rank),
        }
        record.update({f"update/{k}": v for k, v in update.items()})
        record.update(_speculation_record(per_rank))
        record.update(_spot_record(per_rank, timelines))
        self._pending_timeline = [span for t in timelines for span in t.to_records(step)]
        return record

    # ------------------------------------------------------------------ evaluation

    def evaluate(self) -> dict[str, float] | None:
        """Held-out accuracy, greedy and sampled (collective; rank 0 gets the numbers)."""
        if not self.held_out:
            return None
        mine = self.placement.world_share(self.held_out)
        counts = torch.zeros(3, dtype=torch.float64)  # on the CPU on purpose: reduced over gloo
        if mine:
            greedy = self.engine.generate([e.prompt_ids for e in mine], self._sampling(n=1, temperature=0.0, seed=None))
            sampled = self.engine.generate(
                [e.prompt_ids for e in mine],
                self._sampling(n=EVAL_SAMPLES_PER_PROMPT, temperature=self.config.rollout.temperature,
                               seed=_rollout_seed(self.config.trainer.seed, _EVAL_SEED_STEP, self.placement.leader_rank)))
            counts[0] = sum(s.correct for s in self._score(mine, greedy.token_ids, greedy.finish_reasons, 0, 1))
            counts[1] = sum(s.correct for s in self._score(mine, sampled.token_ids, sampled.finish_reasons, 0, 1))
            counts[2] = len(mine)
        if not self.placement.is_leader:  # the engine's other ranks saw the same answers
            counts.zero_()
        dist.all_reduce(counts)
        return {"eval/greedy_accuracy": counts[0].item() / counts[2].item(),
                "eval/sampled_accuracy": counts[1].item() / (EVAL_SAMPLES_PER_PROMPT * counts[2].item())}

    # ------------------------------------------------------------------ the loop

    def _save(self, step: int) -> None:
        checkpoint.save_checkpoint(self.run_dir, step, model=self.model, optimizer=self.optimizer,
                                   meta=policy_source.checkpoint_meta(self.arch, self.config.model.dtype),
                                   sampler_state=self.sampler.state_dict(), dp_rank=self.dp_rank,
                                   keep=self.config.trainer.keep_checkpoints,
                                   rank_state={"bandit": self.engine.bandit_state()})
        if self.drafter_checkpointer is not None:  # written in the background
            self.drafter_checkpointer.save(step, self.drafter_trainer.drafter, self.drafter_trainer.optimizer,
                                           info={"tokens_trained": self.drafter_tokens_total,
                                                 "policy": self.config.model.hf_dir or "tiny default"})

    def _due(self, every: int, step: int) -> bool:
        return step == self.config.trainer.steps or (every > 0 and step % every == 0)

    def run(self) -> list[dict] | None:
        """Train to ``trainer.steps``; returns the summary records on rank 0."""
        t = self.config.trainer
        self._sync(RankTimeline(self.rank))  # the engines start from dummy weights
        if self.start_step == 0:
            self._log_eval(0, self.evaluate())
        for step in range(self.start_step, t.steps):
            record = self.train_step(step)
            done = step + 1
            if self._due(t.eval_every, done):
                metrics = self.evaluate()
                if record is not None and metrics:
                    record.update(metrics)
            if self.reporter is not None:
                self.reporter.log_step(record, self._pending_timeline)
            if self._due(t.save_every, done):
                self._save(done)
        if self.reporter is not None:
            self.reporter.close()
            return self.reporter.records
        return None

    def _log_eval(self, step: int, metrics: dict[str, float] | None) -> None:
        if self.reporter is not None and metrics:
            self.reporter.log_eval(step, metrics)
            run_files.write_atomic(self.run_dir / run_files.EVAL_BEFORE_RL_FILE, json.dumps(metrics, indent=1))

    def close(self) -> None:
        if self.drafter_checkpointer is not None:
            self.drafter_checkpointer.close()  # the last drafter checkpoint reaches the disk
        self.engine.close()


def _spot_duty_cycle(configured: float | None) -> float:
    """drafter.spot_duty_cycle, or its default: a GPU rank trains on its own device, CPU ranks share a memory bus."""
    if configured is not None:
        return configured
    return 1.0 if torch.cuda.is_available() else CPU_SPOT_DUTY_CYCLE


def _spot_step_selected(which: str, step: int) -> bool:
    """Whether the spot trainer works in (1-based) ``step``: every step, or the even or odd ones only."""
    return which == "all" or (step % 2 == 0) == (which == "even")


def _speculation_record(per_rank: list[dict]) -> dict:
    stats = [p["spec"] for p in per_rank if p["spec"] is not None]
    drafts = sum(s.num_drafts for s in stats)
    if drafts == 0:
        return {}
    accepted = sum(s.num_accepted_tokens for s in stats)
    record = {"spec/mean_acceptance_length": 1.0 + accepted / drafts,
              "spec/acceptance_rate": accepted / max(1, sum(s.num_draft_tokens for s in stats))}
    depths = [d for p in per_rank for d in p["step_depths"]]
    if depths:  # BEG-MAB: how often each depth ran, and each engine's best depth per batch-size bucket
        engines = [p for p in per_rank if p["bandit"] is not None]  # their leaders' reports
        record["spec/engine_steps_by_depth"] = {str(k): depths.count(k) for k in sorted(set(depths))}
        record["spec/engine_steps"] = [len(p["step_depths"]) for p in engines]
        record["spec/best_depth_by_bucket"] = [{bucket: s["best"] for bucket, s in p["bandit"].items()}
                                               for p in engines]
    return record


def _spot_record(per_rank: list[dict], timelines: list[RankTimeline]) -> dict:
    reports = [p["spot"] for p in per_rank]
    if any(r is None for r in reports):
        return {}
    slowest_done = max(max(s.end for s in t.spans if s.phase == "rollout" and s.state == BUSY) for t in timelines)
    stats = [p["drafter"] for p in per_rank]
    trained = [s["tokens"] for s in stats]
    losses = [(s["loss"], s["tokens"]) for s in stats if s["tokens"] > 0]
    agreements = [(s["top1_agreement"], s["tokens"]) for s in stats if s["tokens"] > 0]
    weighted = (lambda pairs: sum(v * w for v, w in pairs) / sum(w for _, w in pairs) if pairs else float("nan"))
    return {
        "drafter/tokens_trained": trained,
        "drafter/loss": weighted(losses),
        "drafter/top1_agreement": weighted(agreements),
        "drafter/training_seconds": [r.training_seconds for r in reports],
        "drafter/micro_steps": [r.micro_steps for r in reports],
        "drafter/dropped_micro_steps": [s["dropped_steps"] for s in stats],
        "drafter/buffer_tokens": [s["buffer_tokens"] for s in stats],  # every pipeline stage's ranks have features
        # from the slowest rank finishing its share to this rank leaving rollout: the preemption latency
        "drafter/release_latency_seconds": [r.released_at - slowest_done for r in reports],
        "drafter/failed": any(r.failed for r in reports),
    }


def train_on_rank(config: TLTConfig, run_dir: str, resume: bool) -> list[dict] | None:
    """Entry point of every rank (launched by ``tlt train``)."""
    from megatron_tlt.parallel import ParallelLayout

    layout = ParallelLayout(tensor_parallel_size=config.parallel.tensor_parallel_size,
                            pipeline_parallel_size=config.parallel.pipeline_parallel_size,
                            seed=config.trainer.seed).initialize()
    dist.barrier()  # under torchrun, rank 0 has prepared the run directory (rl/run.py: start_run)
    trainer = None
    try:
        trainer = RLTrainer(config, Path(run_dir), resume=resume)
        return trainer.run()
    finally:
        if trainer is not None:
            trainer.close()
        layout.close()
