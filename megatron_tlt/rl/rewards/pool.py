"""Rewards scored by a pool of Ray actors (``data.reward_workers``), beside the rollout that makes the responses.

For rewards that are slow or unsafe: math-verify can hang, code rewards run programs, judges call models.
Each worker resolves the reward from its spec (``rewards.get_reward_fn``) in its own process and scores one
response at a time. A dispatcher thread in this process hands each idle worker the next response and times it:

  * a response not scored within ``timeout_s`` of being handed over gets ``failure_value``, and its worker is
    killed and replaced (a hung call cannot be interrupted any other way);
  * a worker whose process dies (a crash, ``os._exit``, the OOM killer) gives the response it held the same
    value, and is replaced;
  * a reward that raises gives the response ``failure_value``; the worker stays.

Each failure is logged as a WARNING with its reason and counted. ``submit`` never blocks, so the rollout can
hand responses over as they finish (``StreamedScores``); ``scores`` waits for the ones asked for.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence

from megatron_tlt.config import DataConfig
from megatron_tlt.rl.rewards import ray_cluster
from megatron_tlt.rl.rewards.functions import RewardError, get_reward_fn

logger = logging.getLogger(__name__)

FAILURE_KINDS = {"timeout": "reward/timeouts", "worker_crash": "reward/worker_crashes", "error": "reward/errors"}
"""Why a response got the failure value, and the summary.json field that counts each reason per step."""
WORKER_START_TIMEOUT_S = 300.0
"""How long the pool waits for its workers to start (a loaded 2-core machine took ~10 s for four)."""


@dataclasses.dataclass(frozen=True)
class Score:
    reward: float
    failure: str | None = None
    """None: the reward function's own value; else one of FAILURE_KINDS."""
    reason: str = ""


class _RewardWorker:
    """One worker process (a Ray actor, made remote by the pool): the reward, resolved once."""

    def __init__(self, spec: str):
        self._fn = get_reward_fn(spec)

    def ready(self) -> int:
        return os.getpid()

    def score(self, response_text: str, ground_truth: str) -> float:
        return float(self._fn(response_text, ground_truth))


@dataclasses.dataclass
class _Job:
    ticket: int
    started: float


_CLOSE = object()


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


class RewardPool:
    """``workers`` Ray actors scoring ``reward`` (a registered name or "package.module:function"); Ray must be
    initialised in this process (``ray_cluster``). Raises RewardError if the workers cannot start."""

    def __init__(self, reward: str, *, workers: int, timeout_s: float, failure_value: float = 0.0,
                 start_timeout_s: float = WORKER_START_TIMEOUT_S):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if workers < 1:
            raise ValueError(f"a reward pool needs at least one worker, got {workers}")
        self.reward, self.size, self.timeout_s, self.failure_value = reward, workers, timeout_s, failure_value
        # max_restarts=0: the pool replaces a dead worker itself, having first settled the response it held.
        # Workers prefer this process's node (soft: anywhere on a cluster when this node is full).
        self._actor_class = ray.remote(num_cpus=1, max_restarts=0)(_RewardWorker).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True))
        self._events: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        # shared with callers, under _cond:
        self._items: dict[int, tuple[str, str, str]] = {}  # ticket -> (response, ground truth, label)
        self._pending: collections.deque[int] = collections.deque()
        self._results: dict[int, Score] = {}
        self._ready_workers = 0
        self._broken: str | None = None
        self.failures: collections.Counter[str] = collections.Counter()
        self.replaced = 0
        # the dispatcher thread's own:
        self._actors: dict[int, object] = {}
        self._idle: collections.deque[int] = collections.deque()
        self._running: dict[int, _Job] = {}
        self._worker_ids = itertools.count()
        self._tickets = itertools.count()
        for _ in range(workers):
            self._start_worker()
        self._thread = threading.Thread(target=self._dispatch_forever, name="reward-pool", daemon=True)
        self._thread.start()
        self._wait_for_workers(start_timeout_s)

    # ------------------------------------------------------------------ callers

    def submit(self, response_text: str, ground_truth: str, label: str = "") -> int:
        """Queue one response; returns its ticket at once (the rollout calls this between engine steps)."""
        with self._cond:
            ticket = next(self._tickets)
            self._items[ticket] = (response_text, ground_truth, label or f"response {ticket}")
            self._pending.append(ticket)
        self._events.put(None)  # wake the dispatcher
        return ticket

    def done(self, tickets: Sequence[int]) -> int:
        """How many of ``tickets`` are scored already."""
        with self._cond:
            return sum(t in self._results for t in tickets)

    def scores(self, tickets: Sequence[int]) -> list[Score]:
        """The scores of ``tickets``, in order, once all are in; each ticket is handed out once."""
        with self._cond:
            while self._broken is None and not all(t in self._results for t in tickets):
                self._cond.wait()
            if self._broken is not None:
                raise RewardError(self._broken)
            return [self._results.pop(t) for t in tickets]

    def close(self) -> None:
        """Stop the dispatcher and kill the workers (the Ray connection stays)."""
        import ray

        if not self._thread.is_alive() and not self._actors:
            return
        self._events.put(_CLOSE)
        self._thread.join(timeout=30)
        for actor in self._actors.values():
            ray.kill(actor, no_restart=True)
        self._actors.clear()

    def _wait_for_workers(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._broken is None and self._ready_workers < self.size:
                if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    self._broken = (f"only {self._ready_workers} of {self.size} reward workers started within "
                                    f"{timeout_s:.0f} s: does the Ray cluster have {self.size} free CPUs?")
            broken = self._broken
        if broken is not None:
            self.close()
            raise RewardError(broken)

    # ------------------------------------------------------------------ the dispatcher thread

    def _start_worker(self) -> None:
        worker = next(self._worker_ids)
        actor = self._actor_class.remote(self.reward)
        self._actors[worker] = actor
        actor.ready.remote().future().add_done_callback(lambda f: self._events.put(("ready", worker, None, f)))

    def _dispatch_forever(self) -> None:
        try:
            while True:
                deadlines = [job.started + self.timeout_s for job in self._running.values()]
                wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
                try:
                    event = self._events.get(timeout=wait_s)
                except queue.Empty:
                    event = None
                if event is _CLOSE:
                    return
                if event is not None:
                    self._handle(*event)
                self._expire_overdue()
                self._hand_out()
        except Exception as err:  # a bug here must not leave callers waiting forever
            logger.exception("the reward pool's dispatcher failed")
            with self._cond:
                self._broken = f"the reward pool's dispatcher failed: {_first_line(err)}"
                self._cond.notify_all()

    def _hand_out(self) -> None:
        while self._idle:
            with self._cond:
                if not self._pending:
                    return
                ticket = self._pending.popleft()
                response_text, ground_truth, _ = self._items[ticket]
            worker = self._idle.popleft()
            self._running[worker] = _Job(ticket, time.monotonic())
            self._actors[worker].score.remote(response_text, ground_truth).future().add_done_callback(
                lambda f, w=worker, t=ticket: self._events.put(("scored", w, t, f)))

    def _handle(self, kind: str, worker: int, ticket: int | None, future) -> None:
        import ray.exceptions as ray_errors

        if worker not in self._actors:
            return  # news of a worker already killed and replaced (its response was settled then)
        if kind == "ready":
            try:
                future.result()
            except Exception as err:
                with self._cond:
                    self._broken = f"a reward worker could not start: {_first_line(err)}"
                    self._cond.notify_all()
                return
            self._idle.append(worker)
            with self._cond:
                self._ready_workers += 1
                self._cond.notify_all()
            return
        job = self._running.get(worker)
        if job is None or job.ticket != ticket:
            return
        del self._running[worker]
        try:
            self._settle(ticket, Score(future.result()))
            self._idle.append(worker)
        except ray_errors.RayTaskError as err:  # the reward raised: the worker itself is fine
            cause = err.cause if isinstance(err.cause, BaseException) else err
            self._fail(ticket, "error", f"the reward raised {_first_line(cause)}")
            self._idle.append(worker)
        except Exception as err:  # the worker's process died (RayActorError) or Ray lost the call
            self._replace(worker)
            self._fail(ticket, "worker_crash", f"its worker died ({_first_line(err)})")

    def _expire_overdue(self) -> None:
        now = time.monotonic()
        for worker, job in list(self._running.items()):
            if now - job.started >= self.timeout_s:
                del self._running[worker]
                self._replace(worker)
                self._fail(job.ticket, "timeout", f"no reward after {self.timeout_s:g} s")

    def _replace(self, worker: int) -> None:
        import ray

        actor = self._actors.pop(worker)
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already gone
            pass
        with self._cond:
            self.replaced += 1
        self._start_worker()

    def _fail(self, ticket: int, kind: str, reason: str) -> None:
        with self._cond:
            label = self._items[ticket][2]
            self.failures[kind] += 1
        logger.warning("reward of %s: %s; it gets %g%s", label, reason, self.failure_value,
                       "" if kind == "error" else "; its worker is replaced")
        self._settle(ticket, Score(self.failure_value, kind, reason))

    def _settle(self, ticket: int, score: Score) -> None:
        with self._cond:
            del self._items[ticket]
            self._results[ticket] = score
            self._cond.notify_all()


class StreamedScores:
    """One rollout's responses, handed to the pool prompt by prompt as the engine finishes them
    (``RolloutEngine.generate(on_finished=...)``): scoring runs while the rollout's tail still generates."""

    def __init__(self, pool: RewardPool, decode: Callable[[list[int]], str], ground_truths: Sequence[str],
                 label: str = "prompt"):
        self._pool, self._decode, self._truths, self._label = pool, decode, list(ground_truths), label
        self._tickets: dict[int, list[int]] = {}
        self.failures: collections.Counter[str] = collections.Counter()
        self.scored_before_wait = 0
        """Responses already scored when ``scores`` was called (scored while the rollout ran)."""

    def on_finished(self, prompt_index: int, responses: Sequence[Sequence[int]]) -> None:
        truth = self._truths[prompt_index]
        self._tickets[prompt_index] = [
            self._pool.submit(self._decode(list(r)), truth, label=f"{self._label} {prompt_index} sample {j}")
            for j, r in enumerate(responses)]

    def scores(self) -> list[list[Score]]:
        """Per prompt, its samples' scores (waits for those still being scored)."""
        missing = [k for k in range(len(self._truths)) if k not in self._tickets]
        if missing:
            raise RuntimeError(f"the engine never returned prompts {missing[:5]}: nothing was scored for them")
        tickets = [self._tickets[k] for k in range(len(self._truths))]
        self.scored_before_wait = self._pool.done([t for group in tickets for t in group])
        per_prompt = [self._pool.scores(group) for group in tickets]
        self.failures.update(s.failure for group in per_prompt for s in group if s.failure is not None)
        return per_prompt


class RankRewardPool:
    """A rank's part in ``data.reward_workers`` (built collectively on every rank): its Ray connection
    (``ray_cluster``) and, where it ``hosts_pool`` (an engine's leader, which scores that engine's responses),
    a pool of ``reward_workers`` workers."""

    def __init__(self, data: DataConfig, *, hosts_pool: bool):
        self.connection = ray_cluster.connect_ranks(data.ray_address, hosts_pool=hosts_pool,
                                                    workers_per_pool=data.reward_workers)
        self.pool = None
        if hosts_pool:
            self.pool = RewardPool(data.reward, workers=data.reward_workers, timeout_s=data.reward_timeout_s,
                                   failure_value=data.reward_failure_value)

    def stream(self, decode: Callable[[list[int]], str], ground_truths: Sequence[str],
               label: str) -> StreamedScores | None:
        """Scoring for one ``generate`` call's prompts (None on a rank without a pool: it scores nothing)."""
        return StreamedScores(self.pool, decode, ground_truths, label) if self.pool is not None else None

    def close(self, *, collective: bool) -> None:
        """Kill this rank's workers and leave Ray: ``collective`` at the end of a run, so the rank that started
        the node's instance stops it last; alone on the way out of an error."""
        if self.pool is not None:
            self.pool.close()
        if collective:
            ray_cluster.disconnect_ranks(self.connection)
        elif self.connection is not None:
            self.connection.close()
