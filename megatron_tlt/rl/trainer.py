"""The RL loop on every rank: rollout -> reward -> log-prob -> update -> sync (DESIGN.md section 1).

Ranks and their work:
  * each data-parallel (DP) rank owns a slice of every step's prompts; the vLLM engines of its
    model-parallel group share them out for rollout, then exchange the results. An engine spans the
    ranks of (a divisor of) the policy's tensor-parallel group (``rl/engine_placement.py``), so with
    PP > 1 each pipeline stage's TP group runs an engine of the whole policy;
  * rewards are scored where a response was generated: inline after the rollout, or with
    ``data.reward_workers`` on a Ray actor pool that scores each prompt's responses as the engine finishes
    them, while the rollout's tail still generates (``rl/rewards/pool.py``); advantages are group-relative
    over the n samples of a prompt (a group never spans DP ranks);
  * the log-prob pass and the update run through Megatron's schedules on the model-parallel group,
    gradients are all-reduced over DP, and the token mean covers the global batch (``rl/update.py``).
    With one optimizer step per rollout (``trainer.updates_per_step=1``, the default) there is no
    log-prob pass: the update's own forward gives the old log-probs and the drafter's features;
  * the sync streams the new weights into every engine (``rl/rank_session.py``).
Rollout ends at a barrier over all ranks, so each rank's idle time in the long tail is measured
exactly; every phase is timed per rank (``timeline/spans.py``). TLT's drafter (``drafter/tlt_drafter.py``)
trains in that idle time, takes the features of the policy's forward (update or log-prob pass) and is pushed into the
engine at the sync if it measured at least as well as the drafter there on a held-out slice of the rollouts
(``rl/held_out_slice.py``, ``drafter/serving.py``); the step's summary record is made from every rank's report
(``rl/run/step_record.py``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_tlt import atomic_files
from megatron_tlt.config import TLTConfig
from megatron_tlt.device import module_device
from megatron_tlt.drafter.neighbour_slowdown import engine_steps
from megatron_tlt.drafter.serving import QualityReport
from megatron_tlt.drafter.tlt_drafter import TailReport, TLTDrafter
from megatron_tlt.model import mcore
from megatron_tlt.rl.actor import CapturedFeatures, compute_logprobs, features_on_every_stage
from megatron_tlt.rl import held_out_slice, rollout_agreement
from megatron_tlt.rl.advantages import equal_reward_group_mask, get_advantage_fn
from megatron_tlt.rl.inputs import curriculum, policy_source
from megatron_tlt.rl.inputs.data import PromptExample
from megatron_tlt.rl.held_out_slice import HeldOutSlice
from megatron_tlt.rl.rank_session import RankSession
from megatron_tlt.rl.rewards.pool import RankRewardPool, StreamedScores
from megatron_tlt.rl.run import checkpoint, checkpoint_paths, metric_loggers, samples_log
from megatron_tlt.rl.run import run_dir as run_files
from megatron_tlt.rl.run.step_record import RankStepReport, RewardPoolReport, step_record
from megatron_tlt.rl.scoring import ResponseScorer, Sample, held_out_accuracy, rollout_seed
from megatron_tlt.rl.update import PolicySequence, agreement_by_forward, policy_update_step
from megatron_tlt.rl.weight_sync import SyncStats
from megatron_tlt.timeline.spans import BUSY, IDLE, RankTimeline

logger = logging.getLogger(__name__)

class RLTrainer:
    """Built collectively on every rank; ``run()`` trains to ``trainer.steps``."""

    def __init__(self, config: TLTConfig, run_dir: Path, *, resume: bool):
        self.config, self.run_dir = config, run_dir
        sampling_seed = config.rollout.sampling_seed
        self._sampling_seed = config.trainer.seed if sampling_seed is None else sampling_seed
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dp_rank, self.dp_size = mcore.data_parallel_rank(), mcore.data_parallel_size()
        self.mp_group = mcore.model_parallel_group()
        self.mp_size = dist.get_world_size(self.mp_group)
        self.is_reporter = self.rank == 0
        self.advantage_fn = get_advantage_fn(config.algorithm.advantage)

        ckpt = checkpoint_paths.latest_checkpoint(run_dir) if resume else None
        if resume and ckpt is None:
            raise checkpoint.CheckpointError(f"{run_dir}: no complete checkpoint to resume from")
        self.session = RankSession(config, resume_dir=ckpt / checkpoint_paths.POLICY_SUBDIR if ckpt else None,
                                   ddp=True, show_progress=self.is_reporter)
        self.model, self.arch, self.tokenizer = self.session.model, self.session.arch, self.session.tokenizer
        self.dataset, self.held_out = self.session.task.dataset, self.session.task.held_out
        self.placement = self.session.placement
        self.reward_pool = None  # before the engine starts: Ray's processes are not pinned to this rank's core
        if config.data.reward_workers:
            self.reward_pool = RankRewardPool(config.data, hosts_pool=self.placement.is_leader)
        self.scorer = ResponseScorer(config.data, self.tokenizer, self.reward_pool)
        self._build_optimizer(resume_state=ckpt is not None)
        self.reference = None
        if config.algorithm.kl_coef != 0.0:  # frozen copy of the starting policy
            self.reference = policy_source.load_policy(config, self.arch, self.session.initial_source)
            self.reference.requires_grad_(False)

        self.sampler = curriculum.prompt_sampler(
            self.dataset.examples, curriculum_steps=config.data.curriculum_steps,
            curriculum_max_prompt_tokens=config.data.curriculum_max_prompt_tokens,
            batch_prompts=config.trainer.prompts_per_step, dp_rank=self.dp_rank, dp_size=self.dp_size,
            seed=config.trainer.seed)
        self.start_step, state = 0, None
        if ckpt is not None:
            state = checkpoint.load_checkpoint_state(ckpt, optimizer=self.optimizer)
            self.sampler.load_state_dict(state["sampler"])
            checkpoint.set_rng_state(state["rng"])
            self.start_step = checkpoint_paths.checkpoint_step(ckpt)
            self.lr_schedule.step(self.start_step * config.trainer.updates_per_step)  # a function of the step
            if self.is_reporter:
                logger.info("resuming %s from step %d (%s)", run_dir, self.start_step, ckpt)

        self._measuring = False  # whether this step measures the drafters on a held-out slice (set per step)
        self.agreement = rollout_agreement.AgreementMonitor.from_config(config.rollout)
        self._agreement_fields: dict[str, float] = {}  # the last step's, on every rank (the same figures)
        self.drafter = TLTDrafter.for_run(config, self.arch, run_dir=run_dir, rank=self.rank, world=self.world,
                                          start_step=self.start_step, is_reporter=self.is_reporter)
        self.engine = self.session.open_engine(
            run_dir / "engines", drafter=self.drafter,
            speculative=self.drafter.engine_speculation() if self.drafter is not None else None)
        if state is not None and state.get("bandit") is not None and config.speculation.adaptive:
            self.engine.load_bandit_state(state["bandit"])  # what it learned about depths goes on
            if self.is_reporter:
                logger.info("BEG-MAB state restored from %s", ckpt)
        self.reporter = None
        if self.is_reporter:
            records = [r for r in run_files.read_summary(run_dir) if r["step"] <= self.start_step]
            run_files.truncate_timeline(run_dir, self.start_step)
            samples_log.truncate(run_dir, self.start_step)
            self.reporter = run_files.RunReporter(
                run_dir, total_steps=config.trainer.steps, start_step=self.start_step, records=records,
                loggers=metric_loggers.open_metric_loggers(config, run_dir, start_step=self.start_step))

    # ------------------------------------------------------------------ set-up helpers

    def _build_optimizer(self, *, resume_state: bool) -> None:
        opt = self.config.optimizer
        self.optimizer = mcore.build_optimizer(self.model, lr=opt.lr, weight_decay=opt.weight_decay,
                                               clip_grad=opt.clip_grad, adam_beta1=opt.adam_beta1,
                                               adam_beta2=opt.adam_beta2, min_lr=opt.min_lr)
        self.lr_schedule = mcore.build_lr_scheduler(
            self.optimizer, lr=opt.lr, min_lr=opt.min_lr, warmup_steps=opt.lr_warmup_steps,
            total_steps=self.config.trainer.steps * self.config.trainer.updates_per_step, style=opt.lr_decay_style)
        if not resume_state and self.config.warmup.continue_optimizer:
            self._continue_warmup_optimizer()

    def _continue_warmup_optimizer(self) -> None:
        """Start RL from the warm-up's Adam state, at RL's learning rate.

        A fresh Adam's first steps are sign-like: every weight moves by ~lr however noisy its gradient,
        and RL gradients from a few hundred samples are mostly noise for most weights of a tiny policy.
        The warm-up's second moments make RL's steps proportional to the gradient instead.
        """
        source = self.session.initial_source
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

    # ------------------------------------------------------------------ one step

    def _rollout(self, step: int, examples: list[PromptExample], timeline: RankTimeline, train_drafter: bool):
        """This engine's share of the prompts answered; returns (its prompts, the engine's result, what the
        drafter did in the tail or None, the reward pool's scoring of it or None)."""
        mine = self.placement.replica_share(examples)  # this engine's share of its DP rank's prompts
        streamed = self.scorer.stream(mine, f"step {step + 1} prompt") if mine else None
        start = time.time()
        result = self.engine.generate(  # the ranks of one engine sample with one seed: the same responses
            [e.prompt_ids for e in mine],
            self.session.sampling(n=self.config.rollout.samples_per_prompt, temperature=self.config.rollout.temperature,
                                  seed=rollout_seed(self._sampling_seed, step, self.placement.leader_rank),
                                  logprobs=True),
            on_finished=streamed.on_finished if streamed is not None else None,
        ) if mine else None
        done = time.time()
        timeline.add("rollout", BUSY, start, done)
        if train_drafter:  # idle until the slowest rank is done: train the drafter meanwhile
            return mine, result, self.drafter.wait_for_rollout_end(timeline), streamed
        dist.barrier()  # the phase ends when the slowest rank is done; until then this rank idles
        timeline.add("rollout", IDLE, done, time.time())
        return mine, result, None, streamed

    def _score_and_share(self, mine, result, timeline: RankTimeline,
                         streamed: StreamedScores | None) -> tuple[list[Sample], list[Sample]]:
        """Score this engine's responses (or collect the pool's scores); return (the samples this rank reports,
        all samples of this DP rank in group order). Only an engine's leader reports its samples, so none
        counts twice."""
        p = self.placement
        with timeline.phase("reward"):
            own = self.scorer.score(mine, result.token_ids, result.finish_reasons, p.index_in_replica,
                                    p.engines_per_replica, streamed, result.logprobs) if mine else []
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

    @property
    def _on_policy_update(self) -> bool:
        """One optimizer step per rollout: the policy that generated it is the one the update starts from, so the
        update's own forward gives the old log-probs (detached) and the drafter features, and the step runs no
        log-prob pass of its own (as VeRL does on-policy). With several mini-batches the policy moves between
        them: the old log-probs must be taken before the first."""
        return self.config.trainer.updates_per_step == 1

    def _wants_features(self, train_drafter: bool) -> bool:
        """Whether the step's passes capture drafter features: to train on, or for the held-out measure (set per step:
        the slice takes its sequences from the capture where it covers them)."""
        return self.config.trainer.capture_hidden_states or train_drafter or self._measuring

    def _logprob_pass(self, sequences: list[list[int]], timeline: RankTimeline, train_drafter: bool,
                      held_out: HeldOutSlice):
        """Old log-probs (None on-policy) and reference log-probs (None without the KL term) of the step's
        sequences, and the drafter feature rows captured here (handed to the drafter when it trains this step)."""
        t = self.config.trainer
        old, ref, feature_rows = None, None, 0
        with timeline.phase("logprob"):
            if not self._on_policy_update:
                # features are cut to what the drafter buffer keeps: a step's rollouts can be far larger
                result = compute_logprobs(self.model, sequences, vocab_size=self.arch.vocab_size,
                                          micro_batch_size=t.micro_batch_size, pad_id=self.tokenizer.pad_id,
                                          micro_batch_tokens=t.micro_batch_tokens,
                                          capture_hidden=self._wants_features(train_drafter),
                                          max_feature_rows=self.config.drafter.buffer_tokens)
                old = result.token_logprobs
                feature_rows = self._keep_features(sequences, result, train_drafter, list(range(len(sequences))),
                                                   held_out)
            if self.reference is not None:
                ref = compute_logprobs(self.reference, sequences, vocab_size=self.arch.vocab_size,
                                       micro_batch_size=t.micro_batch_size, pad_id=self.tokenizer.pad_id,
                                       micro_batch_tokens=t.micro_batch_tokens).token_logprobs
        return old, ref, feature_rows

    def _keep_features(self, sequences: list[list[int]], captured: CapturedFeatures, train_drafter: bool,
                       sample_indices: list[int], held_out: HeldOutSlice) -> int:
        """Hand the captured features to the drafter when it trains this step, but for the held-out slice's, which
        go to the slice (``sample_indices``: each sequence's index among the step's samples); returns their rows
        (0 off the last stage)."""
        held_out.take_from(captured, sample_indices)
        if train_drafter:  # every pipeline stage's idle ranks train: the last stage shares its features
            kept, features = features_on_every_stage(self.model, sequences, captured)
            trained = [k for k, i in enumerate(captured.feature_indices) if sample_indices[i] not in held_out]
            self.drafter.add_features([kept[k] for k in trained], [features[k] for k in trained])
        return sum(captured.feature_rows) if captured.features is not None else 0

    def _held_out_slice(self, samples: list[Sample], sequences: list[list[int]], advantages: list[float],
                        train_drafter: bool, timeline: RankTimeline) -> HeldOutSlice:
        """The step's held-out slice for the drafter's measure (``rl/held_out_slice.py``), with the features of the
        sequences the update's forward will not capture already taken (collective over the model-parallel group)."""
        chosen = held_out_slice.choose(samples, self.config.drafter.quality_rows) if self._measuring else []
        in_update = set()
        if self._wants_features(train_drafter):  # a later pass captures features: the update's or the log-prob pass's
            # on-policy the update's forward sees only the groups the equal-reward filter keeps (advantage not NaN)
            in_update = {i for i in chosen if not self._on_policy_update or advantages[i] == advantages[i]}
        held_out = HeldOutSlice(samples, sequences, chosen, in_update=in_update)
        with timeline.phase("logprob"):
            t = self.config.trainer
            held_out.forward_the_rest(self.model, vocab_size=self.arch.vocab_size, micro_batch_size=t.micro_batch_size,
                                      pad_id=self.tokenizer.pad_id, micro_batch_tokens=t.micro_batch_tokens)
        return held_out

    def _features_of_dropped_groups(self, sequences: list[list[int]], advantages: list[float], train_drafter: bool,
                                    held_out: HeldOutSlice, timeline: RankTimeline) -> int:
        """With ``drafter.features_from_every_group``: the drafter features of the groups the equal-reward filter
        leaves out of the on-policy update (its forward captures only those it trains on), by one forward of their
        own before the update, handed to the drafter; returns their rows. Collective over the model-parallel group
        (the ranks of a replica hold the same advantages)."""
        if not (train_drafter and self._on_policy_update and self.config.drafter.features_from_every_group):
            return 0
        dropped = [i for i, advantage in enumerate(advantages) if advantage != advantage and i not in held_out]
        if not dropped:
            return 0
        t = self.config.trainer
        with timeline.phase("logprob"):
            captured = compute_logprobs(self.model, [sequences[i] for i in dropped], vocab_size=self.arch.vocab_size,
                                        micro_batch_size=t.micro_batch_size, pad_id=self.tokenizer.pad_id,
                                        micro_batch_tokens=t.micro_batch_tokens, capture_hidden=True,
                                        max_feature_rows=self.config.drafter.buffer_tokens)
            return self._keep_features([sequences[i] for i in dropped], captured, train_drafter, dropped, held_out)

    def _update(self, samples: list[Sample], token_ids: list[list[int]], advantages: list[float], old, ref,
                timeline: RankTimeline, train_drafter: bool, held_out: HeldOutSlice) -> tuple[dict, int, dict]:
        """The step's optimizer steps; returns their mean metrics, the drafter feature rows the update's forward
        captured (on-policy only; the log-prob pass captures them otherwise) and the engine's agreement with the
        trainer's log-probs (``rollout_agreement.summary_fields``: the same on every rank)."""
        t = self.config.trainer
        device = module_device(self.model)  # where the log-prob pass left ``old`` and ``ref``
        sequences = []
        for i, (sample, ids, advantage) in enumerate(zip(samples, token_ids, advantages)):
            if advantage != advantage:  # NaN: its group was filtered out
                continue
            # Only the last pipeline stage computes the loss; earlier stages carry placeholders.
            placeholder = torch.zeros(len(ids) - 1, device=device)
            sequences.append((i, PolicySequence(
                token_ids=ids, prompt_len=len(sample.prompt_ids),
                old_logprobs=None if self._on_policy_update else old[i] if old else placeholder, advantage=advantage,
                ref_logprobs=(ref[i] if ref else placeholder) if self.reference is not None else None,
                rollout_logprobs=rollout_agreement.label_row(sample, device))))
        capture = self._on_policy_update and self._wants_features(train_drafter)
        metrics: dict[str, list[float]] = {}
        per_update: list[dict[str, float]] = []  # each optimizer step's agreement, combined over the step's tokens
        feature_rows = 0
        with timeline.phase("update"):
            for u in range(t.updates_per_step):  # mini-batches interleave short and long sequences
                mini_indices = [i for i, _ in sequences if i % t.updates_per_step == u]
                mini = [seq for i, seq in sequences if i % t.updates_per_step == u]
                # Advanced before the step, so optimizer step k runs at the schedule's k-th value
                # (Megatron's scheduler starts at init_lr 0, which would waste the first step).
                self.lr_schedule.step(1)
                metrics.setdefault("lr", []).append(self.optimizer.param_groups[0]["lr"])
                # On-policy the features come from the update's forward: of the sequences it trains on (groups
                # of equal rewards are left out of it).
                result = policy_update_step(self.model, self.optimizer, mini, vocab_size=self.arch.vocab_size,
                                            micro_batch_size=t.micro_batch_size, pad_id=self.tokenizer.pad_id,
                                            micro_batch_tokens=t.micro_batch_tokens,
                                            settings=self.config.algorithm, capture_features=capture,
                                            max_feature_rows=self.config.drafter.buffer_tokens,
                                            agreement_bound=self.config.rollout.agreement_bound)
                if capture:
                    feature_rows += self._keep_features([seq.token_ids for seq in mini], result.features,
                                                        train_drafter, mini_indices, held_out)
                for key, value in rollout_agreement.without_agreement(result.metrics).items():
                    metrics.setdefault(key, []).append(value)
                per_update.append(result.metrics)
        metrics = {key: statistics.fmean(values) for key, values in metrics.items()}
        agreement = rollout_agreement.combine(per_update)
        if not agreement["agreement_tokens"]:  # every group filtered out: the engine is checked all the same
            checked = [PolicySequence(token_ids=token_ids[i], prompt_len=len(samples[i].prompt_ids), old_logprobs=None,
                                      advantage=0.0, rollout_logprobs=rollout_agreement.label_row(samples[i], device))
                       for i in rollout_agreement.spread(len(samples), rollout_agreement.FALLBACK_SEQUENCES)]
            with timeline.phase("logprob"):
                agreement = agreement_by_forward(self.model, checked, vocab_size=self.arch.vocab_size,
                                                 micro_batch_size=t.micro_batch_size, pad_id=self.tokenizer.pad_id,
                                                 micro_batch_tokens=t.micro_batch_tokens,
                                                 bound=self.config.rollout.agreement_bound)
        return metrics, feature_rows, rollout_agreement.summary_fields(agreement)

    def _sync(self, timeline: RankTimeline) -> SyncStats:
        with timeline.phase("sync"):
            return self.session.sync(self.engine, self.drafter, probe=True)

    def train_step(self, step: int) -> tuple[dict, list[dict]] | None:
        """One RL step (collective); returns on rank 0 the summary record and the step's timeline spans,
        None elsewhere."""
        timeline = RankTimeline(self.rank)
        step_start = time.time()
        examples = self.dataset.gather(next(self.sampler))
        train_drafter = self.drafter is not None and self.drafter.trains_in(step + 1)
        self._measuring = self.drafter is not None and self.drafter.measures_in(step + 1)
        serially = train_drafter and self.drafter.trains_serially  # the peers' schedule, not TLT's
        mine, result, tail, streamed = self._rollout(step, examples, timeline, train_drafter and not serially)
        # The acceptance alarm after the last sync and drafter push, read from this rollout's own drafts: free.
        alarm = result is not None and self.engine.check_acceptance(result.spec, "the rollout after the policy sync")
        own, samples = self._score_and_share(mine, result, timeline, streamed)
        advantages, dropped_groups = self._advantages(samples)
        sequences = [list(s.prompt_ids) + s.response_ids for s in samples]
        # Colocated: the engine's KV cache and weights leave the GPU while Megatron trains, as tlt plan counts it.
        self.engine.release_memory()
        held_out = self._held_out_slice(samples, sequences, advantages, train_drafter, timeline)
        dropped_rows = self._features_of_dropped_groups(sequences, advantages, train_drafter, held_out, timeline)
        old, ref, feature_rows = self._logprob_pass(sequences, timeline, train_drafter, held_out)
        feature_rows += dropped_rows
        update_metrics, update_feature_rows, self._agreement_fields = self._update(samples, sequences, advantages, old, ref, timeline,
                                                           train_drafter, held_out)
        feature_rows += update_feature_rows
        if serially:  # after the update, on the critical path, on this step's features
            tail = self.drafter.train_serially(timeline)
        self.engine.resume_memory()
        quality = None
        if self._measuring:  # before the sync: it pushes the drafter the gate lets through
            with timeline.phase("sync"):
                quality = self.drafter.measure_and_gate(held_out.measured)
            if quality is not None:
                quality = dataclasses.replace(quality, seconds=quality.seconds + held_out.forward_seconds)
        synced = self._sync(timeline)
        report = self._report(own, result, timeline, dropped_groups, tail, feature_rows, synced, alarm, streamed,
                              quality)
        gathered = [None] * self.world if self.is_reporter else None
        dist.gather_object(report, gathered, dst=0)
        record = None
        if self.is_reporter:
            record = step_record(step + 1, gathered, update_metrics, synced.gb_per_s, time.time() - step_start,
                                 ranks_per_node=self.session.ranks_per_node)
            record.update(self._agreement_fields)
            if self.config.trainer.log_samples:
                self.reporter.log_samples(step + 1, samples_log.sample_records(
                    step + 1, own, lambda ids: self.tokenizer.decode(list(ids), skip_special_tokens=False),
                    self.config.trainer.log_samples))
        if self.drafter is not None:  # backs off where training in the tail slowed the generating ranks
            self.drafter.adapt_duty_cycle(record.get("drafter/spot_rollout_cost") if record else None)
        if not self.is_reporter:
            return None
        return record, [span for r in gathered for span in r.timeline.to_records(step + 1)]

    def _report(self, own: list[Sample], result, timeline: RankTimeline, dropped_groups: int,
                tail: TailReport | None, feature_rows: int, synced: SyncStats, rollout_alarm: bool,
                streamed: StreamedScores | None, quality: QualityReport | None) -> RankStepReport:
        leader = self.placement.is_leader  # an engine's figures, once: from its leader
        pool = None
        if streamed is not None:
            pool = RewardPoolReport(scored=len(own), scored_in_rollout=streamed.scored_before_wait,
                                    failures=dict(streamed.failures))
        return RankStepReport(
            timeline=timeline, rewards=[s.reward for s in own], correct=[s.correct for s in own],
            lengths=[len(s.response_ids) for s in own], truncated=[s.finish_reason == "length" for s in own],
            sampled_nll=(-sum(sum(s.rollout_logprobs) for s in own)
                         if own and own[0].rollout_logprobs is not None else None),
            dropped_groups=dropped_groups if dist.get_rank(self.mp_group) == 0 else 0,
            spec=result.spec if result is not None and leader else None,
            step_depths=result.step_depths if result is not None and leader else [],
            bandit=self.engine.bandit_summary() if leader else None, tail=tail,
            probe=synced.probe if leader else None, alarm=(rollout_alarm or synced.alarm) and leader,
            integrity=self.session.drafter_integrity_report(self.engine) if leader else None,
            # counted once per replica: the last stage's TP ranks hold the same features
            hidden_tokens=feature_rows if mcore.stage_info().tp_rank == 0 else 0, reward_pool=pool,
            speedup_estimate=result.speedup_estimate if result is not None and leader else None, quality=quality,
            engine_steps=engine_steps(result.step_started_at, result.step_seconds, result.step_batch_sizes,
                                      result.step_depths) if result is not None and leader else [])

    def evaluate(self) -> dict[str, float] | None:
        """Held-out accuracy, greedy and sampled (collective; rank 0 gets the numbers)."""
        return held_out_accuracy(self.held_out, self.engine, self.session, self.placement, self.scorer,
                                 temperature=self.config.rollout.temperature, seed=self.config.trainer.seed)

    # ------------------------------------------------------------------ the loop

    def _save(self, step: int) -> None:
        checkpoint.save_checkpoint(self.run_dir, step, model=self.model, optimizer=self.optimizer,
                                   meta=policy_source.checkpoint_meta(self.arch, self.config.model.dtype),
                                   sampler_state=self.sampler.state_dict(), dp_rank=self.dp_rank,
                                   keep=self.config.trainer.keep_checkpoints,
                                   rank_state={"bandit": self.engine.bandit_state()},
                                   tokenizer_dir=self.tokenizer.directory)
        if self.drafter is not None:
            self.drafter.save(step)

    def _due(self, every: int, step: int) -> bool:
        return step == self.config.trainer.steps or (every > 0 and step % every == 0)

    def run(self) -> list[dict] | None:
        """Train to ``trainer.steps``; returns the summary records on rank 0."""
        t = self.config.trainer
        self._sync(RankTimeline(self.rank))  # the engines start from dummy weights
        if self.start_step == 0:
            self._log_eval(0, self.evaluate())
        for step in range(self.start_step, t.steps):
            outcome = self.train_step(step)
            done = step + 1
            if self._due(t.eval_every, done):
                metrics = self.evaluate()
                if outcome is not None and metrics:
                    outcome[0].update(metrics)
            if self.reporter is not None:
                self.reporter.log_step(*outcome, refresh_views=self._due(t.save_every, done))
            self._check_agreement(done)  # after the step is logged: a run it stops keeps its record
            if self._due(t.save_every, done):
                self._save(done)
        if self.reward_pool is not None:
            self.reward_pool.close(collective=True)
        if self.reporter is not None:
            self.reporter.close()
            return self.reporter.records
        return None

    def _check_agreement(self, step: int) -> None:
        """Say a step where the engine and the trainer disagree past the bound; stop a run whose engine is not the
        policy (every rank raises at once: they hold the same all-reduced figures)."""
        try:
            line = self.agreement.check(step, self._agreement_fields)
        except rollout_agreement.RolloutMismatchError:
            dist.barrier()  # every rank stops here, after rank 0 logged the step: none is killed mid-report
            raise
        if line is not None and self.is_reporter:  # a warning reaches the console from rank 0's log: said once
            logger.warning(line)

    def _log_eval(self, step: int, metrics: dict[str, float] | None) -> None:
        if self.reporter is not None and metrics:
            self.reporter.log_eval(step, metrics)
            atomic_files.write_text_atomic(self.run_dir / run_files.EVAL_BEFORE_RL_FILE, json.dumps(metrics, indent=1))

    def close(self) -> None:
        if self.reporter is not None:  # after an error too: the trace and PNG show the last step logged
            try:
                self.reporter.refresh_views()
            except Exception:  # a view must not hide the error that ended the run, nor stop the cleanup
                logger.exception("could not redraw the timeline views (timeline.jsonl holds every span)")
        if self.reward_pool is not None:
            self.reward_pool.close(collective=False)  # after an error; a finished run closed it collectively
        if self.drafter is not None:
            self.drafter.close()  # the last drafter checkpoint reaches the disk
        self.session.close()
