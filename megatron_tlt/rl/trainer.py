"""The RL loop on every rank: five phases a step, one module each under ``rl/phases/`` (DESIGN.md section 1).

  rollout -> reward -> policy pass (log-probs, update) -> sync -> report

Each data-parallel (DP) rank owns a slice of every step's prompts; the vLLM engines of its model-parallel group
share them out (``rl/engine_placement.py``). TLT's drafter takes part through the hooks of
``drafter/step_hooks.py``: it trains in the rollout's long tail, takes the features of the policy's forward, and
is pushed into the engine at the sync if it measured at least as well as the one there; a ``NullDrafter`` stands
in where TLT is off.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from megatron_tlt.config import TLTConfig
from megatron_tlt.drafter.tlt_drafter import TLTDrafter
from megatron_tlt.parallel import ParallelLayout
from megatron_tlt.rl import policy_optimizer, rollout_agreement
from megatron_tlt.rl.inputs import curriculum, policy_source
from megatron_tlt.rl.phases.policy_pass import PolicyPass
from megatron_tlt.rl.phases.report import ReportPhase, StepOutcome
from megatron_tlt.rl.phases.reward import RewardPhase
from megatron_tlt.rl.phases.rollout import RolloutPhase
from megatron_tlt.rl.phases.sync import SyncPhase
from megatron_tlt.rl.rank_session import RankSession
from megatron_tlt.rl.rewards.pool import RankRewardPool
from megatron_tlt.rl.run import checkpoint, checkpoint_paths, run_state
from megatron_tlt.rl.scoring import ResponseScorer, held_out_accuracy
from megatron_tlt.timeline.spans import RankTimeline

logger = logging.getLogger(__name__)


class RLTrainer:
    """Built collectively on every rank; ``run()`` trains to ``trainer.steps``."""

    def __init__(self, config: TLTConfig, run_dir: Path, layout: ParallelLayout, *, resume: bool):
        self.config, self.run_dir, self.layout, self.rank = config, run_dir, layout, layout.rank
        ckpt = checkpoint_paths.latest_checkpoint(run_dir) if resume else None
        if resume and ckpt is None:
            raise checkpoint.CheckpointError(f"{run_dir}: no complete checkpoint to resume from")
        self.session = s = RankSession(config, resume_dir=ckpt / checkpoint_paths.POLICY_SUBDIR if ckpt else None,
                                       ddp=True, show_progress=self.rank == 0)
        # before the engine starts: Ray's processes are not pinned to this rank's core
        self.reward_pool = RankRewardPool(config.data, hosts_pool=s.placement.is_leader) if config.data.reward_workers \
            else None
        self.scorer = ResponseScorer(config.data, s.tokenizer, self.reward_pool)
        self.optimizer, self.lr_schedule = policy_optimizer.build(config, s.model, s.initial_source,
                                                                  resuming=ckpt is not None, is_reporter=self.rank == 0)
        self.reference = None
        if config.algorithm.kl_coef != 0.0:  # frozen copy of the starting policy
            self.reference = policy_source.load_policy(config, s.arch, s.initial_source).requires_grad_(False)
        self.sampler = curriculum.prompt_sampler(
            s.task.dataset.examples, curriculum_steps=config.data.curriculum_steps,
            curriculum_max_prompt_tokens=config.data.curriculum_max_prompt_tokens,
            batch_prompts=config.trainer.prompts_per_step, dp_rank=layout.data_parallel_rank,
            dp_size=layout.data_parallel_size, seed=config.trainer.seed)
        self.start_step, state = 0, None
        if ckpt is not None:
            self.start_step, state = run_state.restore(ckpt, optimizer=self.optimizer, sampler=self.sampler,
                                                    lr_schedule=self.lr_schedule,
                                                    updates_per_step=config.trainer.updates_per_step)
            if self.rank == 0:
                logger.info("resuming %s from step %d (%s)", run_dir, self.start_step, ckpt)
        self.agreement = rollout_agreement.AgreementMonitor.from_config(config.rollout)
        self.drafter = TLTDrafter.for_run(config, s.arch, run_dir=run_dir, rank=self.rank, world=layout.world_size,
                                          start_step=self.start_step, is_reporter=self.rank == 0)
        self.engine = s.open_engine(run_dir / "engines", drafter=self.drafter,
                                    speculative=self.drafter.engine_speculation())
        if state is not None and state.get("bandit") is not None and config.speculation.adaptive:
            self.engine.load_bandit_state(state["bandit"])  # what it learned about depths goes on
            if self.rank == 0:
                logger.info("BEG-MAB state restored from %s", ckpt)
        self.reporter = None
        if self.rank == 0:
            run_state.record_engine(config, run_dir, s.engine_config)
            self.reporter = run_state.open_reporter(config, run_dir, self.start_step)
        self._build_phases()

    def _build_phases(self) -> None:
        c, s = self.config, self.session
        self.rollout = RolloutPhase(session=s, engine=self.engine, drafter=self.drafter, scorer=self.scorer,
                                    rollout=c.rollout, seed=c.trainer.seed)
        self.reward = RewardPhase(scorer=self.scorer, placement=s.placement, layout=self.layout,
                                  samples_per_prompt=c.rollout.samples_per_prompt, algorithm=c.algorithm)
        self.policy_pass = PolicyPass(c, model=s.model, reference=self.reference, optimizer=self.optimizer,
                                      lr_schedule=self.lr_schedule, engine=self.engine, drafter=self.drafter,
                                      vocab_size=s.arch.vocab_size, pad_id=s.tokenizer.pad_id)
        self.sync = SyncPhase(session=s, engine=self.engine, drafter=self.drafter)
        self.report = ReportPhase(session=s, layout=self.layout, engine=self.engine, drafter=self.drafter,
                                  tokenizer=s.tokenizer, reporter=self.reporter, log_samples=c.trainer.log_samples)

    def train_step(self, step: int) -> StepOutcome:
        """One RL step (collective); the outcome's record and spans are rank 0's."""
        timeline, started_at = RankTimeline(self.rank), time.time()
        plan = self.drafter.plan_step(step + 1)
        rollout = self.rollout.run(step, self.session.task.dataset.gather(next(self.sampler)), plan, timeline)
        scored = self.reward.run(rollout, timeline)
        policy = self.policy_pass.run(scored, plan, timeline)
        synced = self.sync.run(plan, policy.feed, timeline)
        return self.report.run(step + 1, started_at, rollout, scored, policy, synced, timeline)

    def evaluate(self) -> dict[str, float] | None:
        """Held-out accuracy, greedy and sampled (collective; rank 0 gets the numbers)."""
        s = self.session
        return held_out_accuracy(s.task.held_out, self.engine, s, s.placement, self.scorer,
                                 temperature=self.config.rollout.temperature, seed=self.config.trainer.seed)

    def run(self) -> list[dict] | None:
        """Train to ``trainer.steps``; returns the summary records on rank 0."""
        t = self.config.trainer
        self.sync.first()  # the engines start from dummy weights
        if self.start_step == 0 and (metrics := self.evaluate()) and self.reporter is not None:
            self.reporter.log_eval(0, metrics)
        for step in range(self.start_step, t.steps):
            outcome, done = self.train_step(step), step + 1
            if self._due(t.eval_every, done) and (metrics := self.evaluate()) and outcome.record is not None:
                outcome.record.update(metrics)
            if self.reporter is not None:
                self.reporter.log_step(outcome.record, outcome.spans, refresh_views=self._due(t.save_every, done))
            # after the step is logged: a run it stops keeps it
            self.agreement.check_on_every_rank(done, outcome.agreement, is_reporter=self.rank == 0)
            if self._due(t.save_every, done):
                self._save(done)
        if self.reward_pool is not None:
            self.reward_pool.close(collective=True)
        if self.reporter is not None:
            self.reporter.close()
            return self.reporter.records
        return None

    def _due(self, every: int, step: int) -> bool:
        return step == self.config.trainer.steps or (every > 0 and step % every == 0)

    def _save(self, step: int) -> None:
        run_state.save(self.config, self.run_dir, step, session=self.session, optimizer=self.optimizer,
                    sampler=self.sampler, engine=self.engine, dp_rank=self.layout.data_parallel_rank)
        self.drafter.save(step)

    def close(self) -> None:
        if self.reporter is not None:  # after an error too: the trace and PNG show the last step logged
            try:
                self.reporter.refresh_views()
            except Exception:  # a view must not hide the error that ended the run, nor stop the cleanup
                logger.exception("could not redraw the timeline views (timeline.jsonl holds every span)")
        if self.reward_pool is not None:
            self.reward_pool.close(collective=False)  # after an error; a finished run closed it collectively
        self.drafter.close()  # the last drafter checkpoint reaches the disk
        self.session.close()
