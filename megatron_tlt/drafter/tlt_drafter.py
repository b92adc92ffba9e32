"""TLT's drafter in the RL step on one rank: its whole life in one place.

The step's phases call it through the hooks of ``drafter/step_hooks.py`` (``NullDrafter`` stands in where TLT
is off) and pass what one phase gives the next:

  rollout      ``engine_speculation()`` says how the rank's engine speculates with it; once this rank's
               share is done, ``idle_tail`` trains it on the idle time until the slowest rank is done (the
               spot trainer, preempted at once), then makes every replica the token-weighted mean, so every
               engine gets one version, and returns what it did (``TailReport``);
  policy pass  ``take_features`` takes the policy's fresh features of the step's sequences; ``after_update``
               trains it there under the serial schedule;
  sync         ``candidate_and_push`` gates the drafter trained since the last decision; the rank session's
               sync hands it the policy's new embedding and LM head (``set_policy_heads``) and pushes
               ``export_tensors()`` into the engine;
  report       ``adapt_duty_cycle`` backs the spot trainer off where it slowed the generating ranks;
  save         ``save`` writes it beside the policy checkpoint, in the background.

``summary_fields`` turns every rank's ``TailReport`` into the step's ``drafter/*`` fields, among them the
precision it trains in (``drafter/precision``: fp32, bf16, fp8 (transformer_engine), fp8 (torchao)) and why
(``drafter/precision_reason``: the setting as given, or what ``auto`` went by), which rank 0 also logs when the
drafter is built.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_tlt.config import TLTConfig
from megatron_tlt.device import compute_device
from megatron_tlt.drafter import checkpoint_paths, checkpointer, store
from megatron_tlt.drafter.device_defaults import quality_every, spot_duty_cycle
from megatron_tlt.drafter.model import EagleDrafter
from megatron_tlt.drafter.neighbour_slowdown import DutyCycleController, NeighbourSlowdown
from megatron_tlt.drafter.pack_budget import PackBudget
from megatron_tlt.drafter.precision import resolve_precision, start_up_line
from megatron_tlt.drafter.serving import MeasureSettings, QualityReport, ServingDrafter
from megatron_tlt.drafter.spot import DeviceIdleProbe, SpotReport, SpotTrainer
from megatron_tlt.drafter.step_hooks import DrafterStepPlan, NullDrafter
from megatron_tlt.drafter.trainer import DrafterTrainer
from megatron_tlt.formats.architecture import PolicyArchitecture
from megatron_tlt.spec.engine import SpeculativeSettings
from megatron_tlt.timeline.spans import BUSY, RankTimeline

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TailReport:
    """What one rank's drafter did in one rollout's long tail."""

    spot: SpotReport
    stats: dict
    """``DrafterTrainer.phase_stats()``: loss, top-1 agreement, tokens, dropped steps, buffer tokens."""
    precision: str
    """The path the drafter trains through (``DrafterPrecision.label``)."""
    precision_reason: str = ""
    """Why that path (``DrafterPrecision.reason``)."""
    duty_cycle: float = 1.0
    """The share of its idle time the spot trainer was allowed to train."""


class TLTDrafter:
    """The drafter replica of this rank, its spot trainer and its checkpoints (built on every rank)."""

    def __init__(self, config: TLTConfig, arch: PolicyArchitecture, *, run_dir: Path, rank: int, world: int,
                 start_step: int, is_reporter: bool):
        d = config.drafter
        self.config, self.arch, self.run_dir = config, arch, run_dir
        precision = resolve_precision(d.precision)  # refuses an fp8 this device cannot run, saying why
        if is_reporter:
            logger.info(start_up_line(d.precision, precision))
        self.trainer = DrafterTrainer(arch, d, seed=config.trainer.seed, precision=precision)
        self.tokens_trained = 0
        """Drafter training tokens over the whole run (kept in its checkpoints)."""
        self._serial_rows_owed = 0
        self._trained_since_decision = 0
        """Tokens trained since the gate last judged the drafter (0: the candidate is the one judged last)."""
        self.checkpointer, self.spot = None, None
        info = self._load(start_step, rank=rank, world=world, is_reporter=is_reporter)
        self.serving = None
        if d.depth > 0 and d.quality_rows > 0:  # measured every quality_every steps, pushed through the gate
            settings = MeasureSettings.from_config(config, depth=d.depth)
            self.serving = ServingDrafter(self.trainer.drafter, settings, pushes=int(info.get("pushes", 0)),
                                          declined=int(info.get("pushes_declined", 0)))
            if info:  # resumed: the reference is still the drafter the run started from
                self.serving.set_reference(self._start_tensors(config))
        if d.spot_training:
            self.checkpointer = checkpointer.AsyncDrafterCheckpointer(run_dir, arch, rank=rank, world=world,
                                                                      keep=config.trainer.keep_checkpoints)
            # No training while a checkpoint write still reads the drafter (it is not copied). Packs are sized to the
            # idle windows (drafter/pack_budget.py): a micro-step that outlasts its window trains nothing.
            self.spot = SpotTrainer(self.trainer.micro_step, DeviceIdleProbe(compute_device().index),
                                    may_train=lambda: not self.checkpointer.writing(),
                                    duty_cycle=spot_duty_cycle(d.spot_duty_cycle),
                                    pack_budget=PackBudget(d.pack_tokens), set_pack_tokens=self.trainer.set_pack_tokens)
        self.duty = None
        if self.spot is not None and d.schedule == "idle" and d.spot_cost_bound is not None:
            self.duty = DutyCycleController(self.spot.duty_cycle, bound=d.spot_cost_bound)
            if "duty_cycle" in info:  # resumed: where the run had backed off to
                self.duty.load_state_dict(info)
                self.spot.set_duty_cycle(self.duty.duty_cycle)

    @classmethod
    def for_run(cls, config: TLTConfig, arch: PolicyArchitecture, **kwargs) -> TLTDrafter | NullDrafter:
        """The run's drafter, or a ``NullDrafter`` when it neither speculates nor trains (TLT off)."""
        d = config.drafter
        if d.depth == 0 and not d.spot_training:
            return NullDrafter()
        return cls(config, arch, **kwargs)

    def _load(self, start_step: int, *, rank: int, world: int, is_reporter: bool) -> dict:
        """A resumed run continues its own drafter (the one its engines served); a new one starts from
        ``drafter.init_dir`` if set. Returns the resumed checkpoint's info ({} for a new run)."""
        found = None
        if start_step > 0 and self.config.drafter.spot_training:
            found = checkpoint_paths.drafter_checkpoint_for(self.run_dir, start_step)
            if found is None and is_reporter:
                logger.warning("%s: no drafter checkpoint at or before step %d; the drafter starts again from "
                               "its initial weights", self.run_dir, start_step)
        if found is not None:
            step, directory = found
            self.trainer.drafter.load_tensors(store.read_drafter_tensors(directory, self.arch))
            info = store.read_drafter_info(directory)
            self.tokens_trained = int(info.get("tokens_trained", 0))
            with_adam = checkpointer.load_adam_state(self.run_dir, step, self.trainer.optimizer, rank=rank, world=world)
            if is_reporter:
                logger.info("drafter resumed from %s (Adam state %s)", directory, "restored" if with_adam else "fresh")
            return info
        if self.config.drafter.init_dir is not None:
            self.trainer.drafter.load_tensors(store.read_drafter_tensors(self.config.drafter.init_dir, self.arch))
        return {}

    def _start_tensors(self, config: TLTConfig) -> dict[str, torch.Tensor]:
        """The drafter a new run of this config starts from: ``drafter.init_dir``'s, else the seeded initialisation."""
        if config.drafter.init_dir is not None:
            return store.read_drafter_tensors(config.drafter.init_dir, self.arch)
        return EagleDrafter(self.arch, seed=config.trainer.seed).export_tensors()

    # ------------------------------------------------------------------ rollout

    def engine_speculation(self) -> SpeculativeSettings | None:
        """How the rank's engine speculates with this drafter (None: it does not)."""
        k = self.config.drafter.depth
        if k == 0:
            return None
        adaptive = self.config.speculation if self.config.speculation.adaptive else None
        return SpeculativeSettings(num_speculative_tokens=k, adaptive=adaptive, seed=self.config.trainer.seed,
                                   acceptance_alarm_threshold=self.config.drafter.acceptance_alarm,
                                   draft_sampling=self.config.speculation.draft_sampling)

    def plan_step(self, step: int) -> DrafterStepPlan:
        """What it does in (1-based) ``step``: train (in the tail, or after the update under ``drafter.schedule:
        serial``) whenever the spot trainer is on, and measure on the first step and every
        ``drafter.quality_every``-th after it (``drafter/serving.py``)."""
        serial = self.config.drafter.schedule == "serial"
        measures = self.serving is not None and (step - 1) % quality_every(self.config.drafter.quality_every) == 0
        return DrafterStepPlan(trains_in_tail=self.spot is not None and not serial,
                               trains_serially=self.spot is not None and serial, measures=measures)

    def idle_tail(self, plan: DrafterStepPlan, timeline: RankTimeline) -> TailReport | None:
        """Once this rank's rollout share is done: train until the slowest rank is done (TLT), or None."""
        return self.wait_for_rollout_end(timeline) if plan.trains_in_tail else None

    def after_update(self, plan: DrafterStepPlan, timeline: RankTimeline) -> TailReport | None:
        """The serial schedule's training, after the update, on this step's features; None under TLT's."""
        return self.train_serially(timeline) if plan.trains_serially else None

    def candidate_and_push(self, plan: DrafterStepPlan, held_out) -> QualityReport | None:
        """Before the sync, in a measuring step: the gate's decision on the drafter trained since the last one
        (``measure_and_gate``); the sync then pushes ``export_tensors()``, the drafter the gate let through."""
        return self.measure_and_gate(held_out) if plan.measures else None

    def train_serially(self, timeline: RankTimeline) -> TailReport:
        """The peers' schedule: ``drafter.serial_tokens`` rows of training on this step's features while the
        step waits (in its update phase), then the replicas' mean, as ``wait_for_rollout_end`` ends."""
        self.trainer.reset_phase_stats()
        self.checkpointer.wait()  # a checkpoint write still reads the drafter (it is not copied)
        # Micro-steps train whole packs: rows owed carry over, so the run trains serial_tokens a step on average.
        self._serial_rows_owed += self.config.drafter.serial_tokens
        spot = self.spot.train_rows(self._serial_rows_owed, timeline, phase="update")
        self._serial_rows_owed -= spot.tokens
        stats = self.trainer.phase_stats()
        with timeline.phase("sync"):
            self._count_trained(self.trainer.average_replicas())
        return TailReport(spot=spot, stats=stats, precision=self.trainer.precision.label,
                          precision_reason=self.trainer.precision.reason)

    def wait_for_rollout_end(self, timeline: RankTimeline) -> TailReport:
        """Train on this rank's idle time until every rank's share is done, then average the replicas."""
        self.trainer.reset_phase_stats()
        spot = self.spot.wait_for_rollout_end(timeline)
        stats = self.trainer.phase_stats()
        with timeline.phase("sync"):  # one drafter version for every engine: the token-weighted mean
            self.checkpointer.wait()  # a write still reading the drafter (rollout shorter than it)
            self._count_trained(self.trainer.average_replicas())
        return TailReport(spot=spot, stats=stats, precision=self.trainer.precision.label,
                          precision_reason=self.trainer.precision.reason, duty_cycle=self.spot.duty_cycle)

    def adapt_duty_cycle(self, cost: NeighbourSlowdown | None) -> None:
        """Set every rank's duty cycle for the next rollout from the cost rank 0 measured in this one (the worst
        node's estimate, ``drafter/spot_rollout_cost``; None elsewhere or where no rank trained). Collective."""
        if self.duty is None:
            return
        rollout_cost = cost.rollout_cost if cost is not None else None
        duty = torch.tensor([self.duty.update(rollout_cost)], dtype=torch.float64, device=compute_device())
        dist.broadcast(duty, src=0)  # rank 0 alone holds the step's record
        self.duty.load_state_dict({"duty_cycle": duty.item()})
        self.spot.set_duty_cycle(self.duty.duty_cycle)

    def _count_trained(self, tokens: int) -> None:
        self.tokens_trained += tokens
        self._trained_since_decision += tokens

    # ------------------------------------------------------------------ log-prob pass, measure and sync

    def take_features(self, token_ids: list[list[int]], features: list[torch.Tensor]) -> None:
        if features:
            self.trainer.add_sequences(token_ids, features)

    def measure_and_gate(self, held_out) -> QualityReport | None:
        """Measure the serving, the starting and a newly trained drafter on this rank's held-out ``(token_ids,
        features, prompt_len)`` sequences, summed over every rank, and push the trained one only if it measures
        at least as well (``drafter/serving.py``). Collective; None where the measure is off."""
        if self.serving is None:
            return None
        embedding_vh, lm_head_vh = self.trainer.policy_heads
        candidate = self.trainer.drafter if self._trained_since_decision else None
        if self.checkpointer is not None:
            self.checkpointer.wait()  # a checkpoint write still reads the serving drafter (it is not copied)
        report = self.serving.measure_and_gate(candidate, held_out, embedding_vh=embedding_vh, lm_head_vh=lm_head_vh)
        self._trained_since_decision = 0
        return report

    @property
    def wants_policy_heads(self) -> bool:
        """Whether a sync should keep the policy's embedding and LM head for it: a drafter that trains uses
        them, and so does the held-out measure (in the engine it drafts with the engine's own)."""
        return self.spot is not None or self.serving is not None

    def set_policy_heads(self, hf_tensors: dict[str, torch.Tensor]) -> None:
        self.trainer.set_policy_heads(hf_tensors)

    def export_tensors(self) -> dict[str, torch.Tensor]:
        """What the engines are given: the serving drafter (the last one the gate let through), or, without the
        held-out measure, the one trained so far."""
        return self.serving.export_tensors() if self.serving is not None else self.trainer.export_tensors()

    # ------------------------------------------------------------------ checkpoints

    def save(self, step: int) -> None:
        """The drafter the engines serve, with the trainer's Adam state, in the background: a resumed run, and an
        export, start from the drafter that last passed the gate."""
        if self.checkpointer is not None:
            served = self.serving.drafter if self.serving is not None else self.trainer.drafter
            info = {"tokens_trained": self.tokens_trained, "policy": self.config.model.hf_dir or "tiny default"}
            if self.serving is not None:
                info.update(pushes=self.serving.pushes, pushes_declined=self.serving.declined)
            if self.duty is not None:
                info.update(self.duty.state_dict())
            self.checkpointer.save(step, served, self.trainer.optimizer, info=info)

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()  # the last drafter checkpoint reaches the disk


@dataclasses.dataclass(frozen=True)
class FrozenDrafter:
    """A drafter that does not train (a benchmark's, or a baseline's): pushed as it is after every sync."""

    tensors: dict[str, torch.Tensor]
    wants_policy_heads: bool = False

    def export_tensors(self) -> dict[str, torch.Tensor]:
        return self.tensors


def summary_fields(reports: list[TailReport | None], timelines: list[RankTimeline]) -> dict:
    """The step's ``drafter/*`` summary fields from every rank's tail report (none when it did not train)."""
    if not reports or any(r is None for r in reports):
        return {}
    slowest_done = max(max(s.end for s in t.spans if s.phase == "rollout" and s.state == BUSY) for t in timelines)
    stats = [r.stats for r in reports]
    trained = [s["tokens"] for s in stats]
    losses = [(s["loss"], s["tokens"]) for s in stats if s["tokens"] > 0]
    precisions = [r.precision for r in reports]
    reasons = [r.precision_reason for r in reports]
    agreements = [(s["top1_agreement"], s["tokens"]) for s in stats if s["tokens"] > 0]
    return {
        # one label where every rank agrees (they resolve the same setting on the same kind of device), else each's
        "drafter/precision": precisions[0] if len(set(precisions)) == 1 else precisions,
        "drafter/precision_reason": reasons[0] if len(set(reasons)) == 1 else reasons,  # a string: not a scalar
        "drafter/tokens_trained": trained,
        "drafter/loss": _weighted_mean(losses),
        "drafter/top1_agreement": _weighted_mean(agreements),
        "drafter/training_seconds": [r.spot.training_seconds for r in reports],
        "drafter/micro_steps": [r.spot.micro_steps for r in reports],
        "drafter/dropped_micro_steps": [s["dropped_steps"] for s in stats],
        # the rows each rank's packs were sized to for its idle windows (drafter/pack_budget.py)
        "drafter/pack_tokens": [r.spot.pack_tokens for r in reports],
        "drafter/buffer_tokens": [s["buffer_tokens"] for s in stats],  # every pipeline stage's ranks have features
        # from the slowest rank finishing its share to this rank leaving rollout: the preemption latency
        # (None where it trained serially, after the update: nothing to release then)
        "drafter/release_latency_seconds": [None if r.spot.released_at is None else r.spot.released_at - slowest_done
                                            for r in reports],
        "drafter/failed": any(r.spot.failed for r in reports),
        "drafter/duty_cycle": reports[0].duty_cycle,  # the same on every rank (rank 0's, broadcast)
    }


def _weighted_mean(pairs: list[tuple[float, int]]) -> float:
    return sum(v * w for v, w in pairs) / sum(w for _, w in pairs) if pairs else float("nan")

