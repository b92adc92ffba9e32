"""The spot trainer: an idle rank trains until the slowest rank is done, the step in flight is preempted, a
failing drafter step never reaches the caller, and a duty cycle below 1 rests in proportion.

Its timing is checked on an exact clock (``Clock``: ``time`` and the end-of-rollout barrier of
``drafter/spot.py`` replaced, micro-steps that take set times), so the figures are exact on any machine.
On real gloo ranks the checks are of order, not duration: the slow rank finishes only when told to by the
fast rank, and the step in flight runs until it sees the asynchronous barrier complete.
"""

import time
from pathlib import Path

import pytest

from megatron_tlt.drafter import spot
from megatron_tlt.drafter.pack_budget import PackBudget
from megatron_tlt.drafter.spot import DeviceIdleProbe, SpotTrainer
from megatron_tlt.launcher import run_on_ranks
from megatron_tlt.timeline.spans import IDLE, TRAINING, RankTimeline

TOKENS = 128
FORWARD, BACKWARD = 0.02, 0.03  # seconds of a micro-step on the exact clock; preemption points after each


class Clock:
    """Stands in for ``time`` and ``torch.distributed`` in drafter/spot.py: time moves only when someone
    sleeps or a micro-step runs; the barrier completes when the clock reaches ``slowest_done``."""

    def __init__(self, slowest_done: float):
        self.now, self.slowest_done = 0.0, slowest_done

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def barrier(self, group=None, async_op=False):
        clock = self

        class Work:
            def is_completed(self) -> bool:
                return clock.now >= clock.slowest_done

            def wait(self) -> None:
                clock.now = max(clock.now, clock.slowest_done)

        return Work()


def _install_clock(monkeypatch, slowest_done: float) -> Clock:
    """An exact clock in place of ``time`` and ``torch.distributed`` in drafter/spot.py."""
    clock = Clock(slowest_done)
    monkeypatch.setattr(spot, "time", clock)
    monkeypatch.setattr(spot, "dist", clock)
    return clock


def _on_the_clock(monkeypatch, slowest_done: float, duty_cycle: float = 1.0, fail_on_call: int | None = None,
                  changed_duty_cycle: float | None = None):
    """One rank's wait for the end of the rollout on the exact clock; returns (report, timeline, the micro-steps
    as (start, end, tokens)). ``changed_duty_cycle``: set on the trainer after it is built, before the wait."""
    clock = _install_clock(monkeypatch, slowest_done)
    steps = []

    def micro_step(should_stop) -> int:  # a drafter pack: forward, backward, each a preemption point
        start = clock.now
        if fail_on_call is not None and len(steps) + 1 == fail_on_call:
            steps.append((start, start, None))
            raise RuntimeError("injected drafter failure")
        tokens = 0
        clock.sleep(FORWARD)
        if not should_stop():
            clock.sleep(BACKWARD)
            tokens = 0 if should_stop() else TOKENS
        steps.append((start, clock.now, tokens))
        return tokens

    timeline = RankTimeline(0)
    trainer = SpotTrainer(micro_step, DeviceIdleProbe(None), duty_cycle=duty_cycle)
    if changed_duty_cycle is not None:
        trainer.set_duty_cycle(changed_duty_cycle)
    report = trainer.wait_for_rollout_end(timeline)
    return report, timeline, steps


def _assert_every_moment_is_accounted_for(report, timeline):
    spans = sorted(timeline.spans, key=lambda s: s.start)
    assert spans[0].start == 0.0 and spans[-1].end == report.released_at
    assert all(a.end == b.start for a, b in zip(spans, spans[1:]))  # TRAINING and IDLE tile the wait
    assert timeline.seconds("rollout", TRAINING) == pytest.approx(report.training_seconds)
    assert timeline.seconds("rollout", IDLE) == pytest.approx(report.idle_seconds)


def test_an_idle_rank_trains_until_the_slowest_rank_is_done_and_is_released_within_one_micro_step(monkeypatch):
    report, timeline, steps = _on_the_clock(monkeypatch, slowest_done=1.0)
    # one grace period, then micro-steps back to back; the one in flight at 1.0 is dropped after its backward
    assert steps[0][0] == pytest.approx(spot.FIRST_STEP_GRACE_SECONDS, abs=spot.POLL_SECONDS)
    assert all(b[0] == a[1] for a, b in zip(steps, steps[1:]))
    assert [tokens for *_, tokens in steps] == [TOKENS] * (len(steps) - 1) + [0]
    assert steps[-1][0] < 1.0 <= steps[-1][1] and all(start < 1.0 for start, *_ in steps)  # none starts after
    assert report.micro_steps == len(steps) - 1 == int((1.0 - steps[0][0]) // (FORWARD + BACKWARD))
    assert report.tokens == TOKENS * report.micro_steps and not report.failed
    assert 1.0 <= report.released_at <= 1.0 + BACKWARD  # at the next preemption point, not the step's end
    _assert_every_moment_is_accounted_for(report, timeline)


def test_the_slowest_rank_starts_no_drafter_step_and_is_released_at_once(monkeypatch):
    # it arrives last: the barrier completes within the grace period that keeps drafter work off its path
    report, timeline, steps = _on_the_clock(monkeypatch, slowest_done=spot.FIRST_STEP_GRACE_SECONDS / 2)
    assert steps == [] and report.micro_steps == 0
    assert report.released_at == pytest.approx(spot.FIRST_STEP_GRACE_SECONDS / 2, abs=spot.POLL_SECONDS)


def test_a_failing_drafter_step_is_logged_and_the_rank_waits_idle_instead(monkeypatch, caplog):
    report, timeline, steps = _on_the_clock(monkeypatch, slowest_done=1.0, fail_on_call=3)
    assert report.failed and report.micro_steps == 2 and len(steps) == 3  # two good steps, none after the third
    assert "drafter training failed on this rank" in caplog.text
    assert report.released_at == pytest.approx(1.0, abs=spot.POLL_SECONDS)
    last = max(timeline.spans, key=lambda s: s.end)
    assert last.state == IDLE and last.start == steps[1][1]  # the rest of the wait is idle
    _assert_every_moment_is_accounted_for(report, timeline)


def test_a_duty_cycle_below_one_rests_between_micro_steps_in_proportion(monkeypatch):
    report, timeline, steps = _on_the_clock(monkeypatch, slowest_done=1.0, duty_cycle=0.25)
    for a, b in zip(steps, steps[1:]):  # each rest is (1 - 0.25) / 0.25 = 3 times the step before it
        assert b[0] - a[1] == pytest.approx(3 * (FORWARD + BACKWARD), abs=spot.POLL_SECONDS), (a, b)
    share = report.training_seconds / (report.training_seconds + report.idle_seconds)
    assert share == pytest.approx(0.25, abs=0.03)
    # the barrier completed while it rested: released at the next poll, not at the end of the rest
    assert steps[-1][2] == TOKENS and report.released_at == pytest.approx(1.0, abs=spot.POLL_SECONDS)
    _assert_every_moment_is_accounted_for(report, timeline)


def test_a_duty_cycle_changed_between_rollouts_rests_by_the_new_one(monkeypatch):
    report, timeline, steps = _on_the_clock(monkeypatch, slowest_done=1.0, duty_cycle=1.0, changed_duty_cycle=0.5)
    for a, b in zip(steps, steps[1:]):  # each rest is (1 - 0.5) / 0.5 = 1 times the step before it
        assert b[0] - a[1] == pytest.approx(FORWARD + BACKWARD, abs=spot.POLL_SECONDS), (a, b)
    _assert_every_moment_is_accounted_for(report, timeline)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5])
def test_a_duty_cycle_outside_zero_to_one_is_refused_and_the_old_one_kept(bad):
    trainer = SpotTrainer(None, DeviceIdleProbe(None), duty_cycle=0.25)
    with pytest.raises(ValueError, match="duty_cycle must be in"):
        trainer.set_duty_cycle(bad)
    assert trainer.duty_cycle == 0.25 and trainer.rest_per_training_second == pytest.approx(3.0)
    trainer.set_duty_cycle(1.0)
    assert trainer.duty_cycle == 1.0 and trainer.rest_per_training_second == 0.0


SECONDS_PER_ROW = 0.004  # a real model's pack on 2 CPU cores: 2,048 rows take 8.2 s
POINTS_PER_STEP = 16  # preemption points, evenly spread over a micro-step


def test_packs_too_long_for_the_idle_windows_are_sized_down_and_train_from_the_next_rollout(monkeypatch):
    # Windows of 6 s: a 2,048-row pack (8.2 s) is dropped in every one of them unless the budget sizes it down.
    clock = _install_clock(monkeypatch, 0.0)
    rows = {"pack": 2048}

    def micro_step(should_stop) -> int:
        for _ in range(POINTS_PER_STEP):
            clock.sleep(SECONDS_PER_ROW * rows["pack"] / POINTS_PER_STEP)
            if should_stop():
                return 0
        return rows["pack"]

    def set_pack_tokens(n: int) -> None:
        rows["pack"] = n

    budget = PackBudget(2048)
    trainer = SpotTrainer(micro_step, DeviceIdleProbe(None), duty_cycle=0.25, pack_budget=budget,
                          set_pack_tokens=set_pack_tokens)
    reports = []
    for _ in range(3):
        clock.slowest_done = clock.now + 6.0
        reports.append(trainer.wait_for_rollout_end(RankTimeline(0)))
    first, second, third = reports
    assert first.pack_tokens == 2048 and first.micro_steps == 0  # nothing measured yet: full packs, all dropped
    # the window is the rollout's 6 s to within a preemption point (0.51 s here), not the dropped step's 8.2 s
    assert first.released_at - 6.0 < 0.52 and 6.0 <= budget.median_window_seconds < 6.0 + 0.52
    # the step dropped after 6.14 s bounds a row at >= 6.14 s / 2,048 = 3.0 ms; 0.5 x 0.25 x 6.15 s at that speed
    # is 256 rows; finished steps then measure 4 ms a row: 0.77 s is 192 rows, rounded down to 128
    assert second.pack_tokens == 256 and second.micro_steps == 2 and second.tokens == 2 * 256
    assert third.pack_tokens == 128 and third.micro_steps == 3 and third.tokens == 3 * 128
    assert third.training_seconds / 6.0 == pytest.approx(0.25, abs=0.01)  # the duty cycle's share of the window


def test_the_slowest_ranks_wait_is_not_an_idle_window(monkeypatch):
    _install_clock(monkeypatch, spot.FIRST_STEP_GRACE_SECONDS / 2)
    budget = PackBudget(2048)
    trainer = SpotTrainer(lambda should_stop: 0, DeviceIdleProbe(None), pack_budget=budget,
                          set_pack_tokens=lambda n: None)
    trainer.wait_for_rollout_end(RankTimeline(0))
    assert budget.median_window_seconds is None
    with pytest.raises(ValueError, match="a pack budget needs set_pack_tokens"):
        SpotTrainer(None, DeviceIdleProbe(None), pack_budget=budget)


def test_a_failure_sizing_the_packs_turns_drafter_training_off_and_the_rank_waits_idle(monkeypatch, caplog):
    _install_clock(monkeypatch, 1.0)
    calls = []

    def set_pack_tokens(n: int) -> None:
        raise RuntimeError("injected")

    trainer = SpotTrainer(lambda should_stop: calls.append(None) or 1, DeviceIdleProbe(None),
                          pack_budget=PackBudget(2048), set_pack_tokens=set_pack_tokens)
    report = trainer.wait_for_rollout_end(RankTimeline(0))
    assert report.failed and report.micro_steps == 0 and calls == [] and report.released_at == pytest.approx(1.0)
    assert "sizing the drafter's packs failed" in caplog.text


# ---------------------------------------------------------------------------------------------- real ranks

STEPS_BEFORE_RELEASE = 3
WAIT_LIMIT_SECONDS = 120  # only a hang guard: every wait below ends on a signal, in milliseconds


def _wait_for(path: Path) -> None:
    deadline = time.time() + WAIT_LIMIT_SECONDS
    while not path.exists():
        if time.time() > deadline:
            raise TimeoutError(f"{path} did not appear within {WAIT_LIMIT_SECONDS} s")
        time.sleep(0.001)


def _rollout_with_spot_training(signal: Path, fail_on_call: int | None, duty_cycle: float) -> dict:
    """Rank 1 holds the long tail until rank 0 has trained STEPS_BEFORE_RELEASE micro-steps and started the
    next (or failed): that step runs until the end of the rollout preempts it."""
    import torch.distributed as dist

    rank = dist.get_rank()
    steps, preempted = [], []

    def micro_step(should_stop) -> int:
        start = time.time()
        steps.append(start)
        if len(steps) == fail_on_call:
            signal.touch()
            raise RuntimeError("injected drafter failure")
        if len(steps) <= STEPS_BEFORE_RELEASE:
            time.sleep(0.01)
            return TOKENS
        signal.touch()  # from inside this step: the rollout cannot end before it starts
        deadline = start + WAIT_LIMIT_SECONDS
        while not should_stop() and time.time() < deadline:  # the step in flight at the end of the rollout
            time.sleep(0.001)
        preempted.append(should_stop())
        return 0  # dropped

    trainer = SpotTrainer(micro_step if rank == 0 else None, DeviceIdleProbe(None), duty_cycle=duty_cycle)
    timeline = RankTimeline(rank)
    if rank == 1:
        _wait_for(signal)
    share_done = time.time()
    report = trainer.wait_for_rollout_end(timeline)
    done_times = [None, None]
    dist.all_gather_object(done_times, share_done)
    return {"report": report, "slowest_done": max(done_times), "steps": steps, "preempted": preempted,
            "spans": sorted(timeline.spans, key=lambda s: s.start)}


SCENARIOS = {"plain": (None, 1.0), "failing": (2, 1.0), "quarter": (None, 0.25)}


def _scenarios_on_ranks(signal_dir: str) -> dict:
    """Every scenario in one process group (a spawn of two ranks costs seconds): {name: [rank 0's, rank 1's]}."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        return {name: _rollout_with_spot_training(Path(signal_dir) / name, *args) for name, args in SCENARIOS.items()}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def on_ranks(tmp_path_factory):
    per_rank = run_on_ranks(_scenarios_on_ranks, 2, str(tmp_path_factory.mktemp("signals")))
    return {name: (per_rank[0][name], per_rank[1][name]) for name in SCENARIOS}


def test_on_gloo_ranks_the_idle_rank_trains_and_the_end_of_the_rollout_preempts_its_step_in_flight(on_ranks):
    fast, slow = on_ranks["plain"]
    report = fast["report"]
    assert report.micro_steps == STEPS_BEFORE_RELEASE and report.tokens == TOKENS * STEPS_BEFORE_RELEASE
    assert fast["preempted"] == [True] and len(fast["steps"]) == STEPS_BEFORE_RELEASE + 1  # none after it
    assert not report.failed and slow["report"].micro_steps == 0
    for rank in (fast, slow):
        assert rank["report"].released_at >= rank["slowest_done"]  # nobody leaves before the slowest is done
        assert rank["report"].released_at - rank["slowest_done"] < WAIT_LIMIT_SECONDS / 10  # hang guard
    assert [s.state for s in fast["spans"]].count(TRAINING) == STEPS_BEFORE_RELEASE


def test_on_gloo_ranks_a_failing_drafter_step_leaves_the_rank_idle_until_the_end(on_ranks):
    fast, _ = on_ranks["failing"]
    report = fast["report"]
    assert report.failed and report.micro_steps == 1 and len(fast["steps"]) == 2  # none after the failure
    assert report.released_at >= fast["slowest_done"]
    assert fast["spans"][-1].state == IDLE and fast["spans"][-1].end == report.released_at


def test_on_gloo_ranks_a_duty_cycle_below_one_rests_at_least_three_times_each_step_at_a_quarter(on_ranks):
    fast, _ = on_ranks["quarter"]
    training = [s for s in fast["spans"] if s.state == TRAINING]
    assert len(training) == STEPS_BEFORE_RELEASE and fast["preempted"] == [True]
    for step, next_start in zip(training, fast["steps"][1:]):
        assert next_start - step.end >= 3 * step.seconds  # rest >= (1 - d) / d of the step before, never less
