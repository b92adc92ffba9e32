"""The Spot Trainer: a rank whose rollout share is done trains the drafter until the slowest rank is done.

Each rank is BUSY (its engine generates its share), IDLE (share done, nothing to train or the
device still busy) or TRAINING (a drafter micro-step in flight). Idle is detected from two signals:
  * the engine's own: ``generate`` returned, so no request of this rank is in flight;
  * on GPU, NVML utilisation of this rank's device (pynvml), so a device still busy with other work
    (e.g. a colocated engine's last kernels) is not trained on. Without NVML it is said once and the
    engine signal alone decides.
The end of rollout is an asynchronous barrier over all ranks. Between micro-steps, and inside one
after each draft step of its forward and of its backward pass, the rank polls it: once the slowest rank
is done, the step in flight is dropped at the next of those points and no new one starts (preemption),
so a rank is released within about one draft step's pass (``DrafterTrainer.micro_step``).

Where ranks share one memory bus (a CPU), an idle rank's training slows the ranks still generating; a
duty cycle below 1 makes it rest between micro-steps in proportion to the time each took.

A micro-step that outlasts the window it starts in trains nothing, so with a ``PackBudget`` each rollout's
packs are sized, before the rank's first micro-step, to the idle windows and training speed this rank has
measured (``drafter/pack_budget.py``).

A failure inside drafter training never reaches the RL run: it is logged once with its traceback,
drafter training stays off for the rest of the run, and the rank waits idle as it would without it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_tlt.drafter.pack_budget import PackBudget
from megatron_tlt.timeline.spans import IDLE, TRAINING, RankTimeline

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.001  # between barrier polls while idle: 1 ms bounds the release latency of an idle rank
# The last rank to arrive sees the barrier complete within a few ms; waiting that long before the
# first micro-step keeps it from starting drafter work on the critical path.
FIRST_STEP_GRACE_SECONDS = 0.005
GPU_BUSY_PERCENT = 10  # NVML utilisation above this means the device is still working for someone else


@dataclasses.dataclass
class SpotReport:
    """What one rank did with its idle time in one rollout phase."""

    micro_steps: int = 0
    tokens: int = 0
    """Drafter training tokens processed."""
    training_seconds: float = 0.0
    idle_seconds: float = 0.0
    """Idle time not spent training (no work, training off, or the device busy)."""
    released_at: float | None = 0.0
    """Wall-clock time the rank left the rollout phase (for the preemption latency); None where the drafter
    trained serially, after the update (``drafter.schedule: serial``)."""
    failed: bool = False
    pack_tokens: int | None = None
    """The rows its drafter packs were sized to in this phase (None: not sized, ``drafter.pack_tokens``)."""


def _nvml_handle(pynvml, cuda_index: int):
    """NVML's handle of CUDA device ``cuda_index``, matched by UUID: NVML numbers the node's physical GPUs,
    CUDA the visible ones (CUDA_VISIBLE_DEVICES, as Slurm sets it, renumbers them)."""
    uuid = getattr(torch.cuda.get_device_properties(cuda_index), "uuid", None)
    if uuid is not None:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except pynvml.NVMLError:  # not run on a GPU here: fall back to the index, right when nothing is hidden
            logger.info("NVML does not know GPU-%s; using NVML device %d", uuid, cuda_index)
    return pynvml.nvmlDeviceGetHandleByIndex(cuda_index)


class DeviceIdleProbe:
    """NVML utilisation of this rank's GPU; always 'quiet' where NVML is unavailable (said once)."""

    def __init__(self, device_index: int | None):
        self._handle = None
        self._nvml = None
        if device_index is None:
            logger.info("no GPU: idle detection uses the engine signal only (NVML not polled)")
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = _nvml_handle(pynvml, device_index)
            self._nvml = pynvml
        except Exception as err:  # no driver, no library, no such device: fall back, once
            logger.info("NVML unavailable (%s): idle detection uses the engine signal only", err)

    def device_quiet(self) -> bool:
        if self._handle is None:
            return True
        return self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu <= GPU_BUSY_PERCENT


class _RolloutEnd:
    """``barrier.is_completed`` (the end-of-rollout barrier's) that notes when this rank first saw it complete:
    where its idle window ended, to within a preemption point (``released_at`` also holds the rest of a step
    that was in flight)."""

    def __init__(self, barrier):
        self.barrier, self.seen_at = barrier, None

    def __call__(self) -> bool:
        if self.seen_at is None and self.barrier.is_completed():
            self.seen_at = time.time()
        return self.seen_at is not None


class SpotTrainer:
    """Runs drafter micro-steps on this rank while it waits for the rest of the rollout.

    ``micro_step(should_stop)`` trains on one pack and returns the tokens it processed, or 0 when there is
    nothing to train on or it dropped the step because ``should_stop()`` said the rollout is over; it
    must not touch the policy, the global RNGs or any process group. With ``pack_budget``,
    ``set_pack_tokens(rows)`` is called once per rollout, before its first micro-step, with the rows the
    micro-steps' packs should hold from then on.
    """

    def __init__(self, micro_step: Callable[[Callable[[], bool]], int] | None, probe: DeviceIdleProbe,
                 may_train: Callable[[], bool] = lambda: True, duty_cycle: float = 1.0,
                 pack_budget: PackBudget | None = None, set_pack_tokens: Callable[[int], None] | None = None):
        if (pack_budget is None) != (set_pack_tokens is None):
            raise ValueError("a pack budget needs set_pack_tokens to apply it, and set_pack_tokens a budget")
        self.set_duty_cycle(duty_cycle)
        self.micro_step = micro_step
        self.probe = probe
        self.may_train = may_train
        self.enabled = micro_step is not None
        self.pack_budget, self.set_pack_tokens = pack_budget, set_pack_tokens
        self._said_sized = False

    @property
    def duty_cycle(self) -> float:
        """Share of its idle time this rank may spend training (it rests the rest, between micro-steps)."""
        return self._duty_cycle

    def set_duty_cycle(self, duty_cycle: float) -> None:
        """Change the duty cycle between rollouts (e.g. where this rank's training slows the ranks still
        generating); the next ``wait_for_rollout_end`` rests by it."""
        if not 0.0 < duty_cycle <= 1.0:
            raise ValueError(f"duty_cycle must be in (0, 1], got {duty_cycle}")
        self._duty_cycle = float(duty_cycle)
        self.rest_per_training_second = (1.0 - duty_cycle) / duty_cycle

    def wait_for_rollout_end(self, timeline: RankTimeline, group=None) -> SpotReport:
        """Called when this rank's share is done; returns once every rank of ``group`` is done."""
        report = SpotReport()
        if self.pack_budget is not None and self.enabled:
            report.pack_tokens = self._size_packs()
        rollout_over = _RolloutEnd(dist.barrier(group=group, async_op=True))
        idle_since = waiting_since = time.time()
        while not rollout_over() and time.time() - idle_since < FIRST_STEP_GRACE_SECONDS:
            time.sleep(POLL_SECONDS)
        rest_until = 0.0
        while not rollout_over():
            if time.time() < rest_until or not (self.enabled and self.may_train() and self.probe.device_quiet()):
                time.sleep(POLL_SECONDS)
                continue
            start = time.time()
            tokens = self.train_one(rollout_over)
            end = time.time()
            if tokens > 0:
                self._close_idle(timeline, report, idle_since, start)
                timeline.add("rollout", TRAINING, start, end)
                report.micro_steps += 1
                report.tokens += tokens
                report.training_seconds += end - start
                idle_since = end
                rest_until = end + (end - start) * self.rest_per_training_second
                if report.pack_tokens is not None:
                    self.pack_budget.record_finished(tokens, end - start)
            elif report.pack_tokens is not None and rollout_over():  # dropped: the rollout ended under it
                self.pack_budget.record_dropped(report.pack_tokens, end - start)
            else:  # nothing to train on this step: wait like an idle rank
                time.sleep(POLL_SECONDS)
        rollout_over.barrier.wait()
        report.released_at = time.time()
        self._close_idle(timeline, report, idle_since, report.released_at)
        if report.pack_tokens is not None:  # the window ends where the rollout ended, not the dropped step's overrun
            self.pack_budget.record_window(rollout_over.seen_at - waiting_since)
        report.failed = self.failed
        return report

    def train_rows(self, rows: int, timeline: RankTimeline, *, phase: str) -> SpotReport:
        """Train at least ``rows`` rows now, as the step's own work (the serial schedule): whole micro-steps,
        nothing preempts them; stops early on an empty buffer or a failure (logged once)."""
        report = SpotReport(released_at=None)
        while self.enabled and report.tokens < rows:
            start = time.time()
            tokens = self.train_one(lambda: False)
            if tokens == 0:
                break
            end = time.time()
            timeline.add(phase, TRAINING, start, end)
            report.micro_steps += 1
            report.tokens += tokens
            report.training_seconds += end - start
        report.failed = self.failed
        return report

    def _size_packs(self) -> int | None:
        """Size this rollout's packs from the budget (said once, the first time they are cut below the most);
        None where that failed (logged, then training stays off, as a failed micro-step leaves it)."""
        budget = self.pack_budget
        rows = budget.tokens(self.duty_cycle)
        if rows < budget.max_tokens and not self._said_sized:
            logger.info("drafter packs sized to %d rows (drafter.pack_tokens %d) to fit this rank's idle windows "
                        "(median %.2f s, %.2f ms a row); longer sequences are split", rows, budget.max_tokens,
                        budget.median_window_seconds, 1000 * budget.seconds_per_token)
            self._said_sized = True
        try:
            self.set_pack_tokens(rows)
        except Exception:
            self._turn_off_after("sizing the drafter's packs")
            return None
        return rows

    @property
    def failed(self) -> bool:
        """Drafter training failed on this rank and is off for the rest of the run."""
        return not self.enabled and self.micro_step is not None

    def train_one(self, should_stop: Callable[[], bool]) -> int:
        """One micro-step; its tokens, or 0 (nothing to train, dropped, or failed: logged once, then off)."""
        try:
            return int(self.micro_step(should_stop))
        except Exception:
            self._turn_off_after("drafter training")
            return 0

    def _turn_off_after(self, what: str) -> None:
        """Inside an ``except``: log the failure once with its traceback and keep drafter training off from now on."""
        logger.exception("%s failed on this rank; drafter training stays off for the rest of the run (the RL run "
                         "itself is not affected)", what)
        self.enabled = False

    @staticmethod
    def _close_idle(timeline: RankTimeline, report: SpotReport, start: float, end: float) -> None:
        if end > start:
            timeline.add("rollout", IDLE, start, end)
            report.idle_seconds += end - start
