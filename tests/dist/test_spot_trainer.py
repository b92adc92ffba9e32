"""The spot trainer on real gloo ranks: an idle rank trains until the slowest rank is done, is released
within one drafter micro-step of it, and a failing drafter step never reaches the caller."""

import time

from megatron_tlt.launcher import run_on_ranks

MICRO_STEP_SECONDS = 0.05
SLOW_RANK_SECONDS = 1.0


def _rollout_with_spot_training(fail_on_call: int | None, duty_cycle: float = 1.0):
    import torch.distributed as dist

    from megatron_tlt.drafter.spot import DeviceIdleProbe, SpotTrainer
    from megatron_tlt.timeline import IDLE, TRAINING, RankTimeline

    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        calls = []

        def micro_step(should_stop) -> int:  # stands in for one drafter pack: fixed time, fixed tokens
            calls.append(time.time())
            if fail_on_call is not None and len(calls) == fail_on_call:
                raise RuntimeError("injected drafter failure")
            time.sleep(MICRO_STEP_SECONDS)
            return 128

        spot = SpotTrainer(micro_step, DeviceIdleProbe(None), duty_cycle=duty_cycle)
        timeline = RankTimeline(rank)
        time.sleep(SLOW_RANK_SECONDS if rank == 1 else 0.0)  # rank 1 holds the long tail
        share_done = time.time()
        report = spot.wait_for_rollout_end(timeline)
        done_times = [None, None]
        dist.all_gather_object(done_times, share_done)
        return {
            "report": report, "slowest_done": max(done_times), "calls": len(calls),
            "training": timeline.seconds("rollout", TRAINING), "idle": timeline.seconds("rollout", IDLE),
        }
    finally:
        dist.destroy_process_group()


def test_an_idle_rank_trains_until_the_slowest_rank_is_done_and_is_released_within_one_micro_step():
    results = run_on_ranks(_rollout_with_spot_training, 2, None, 1.0)
    fast, slow = results[0], results[1]
    report = fast["report"]
    # ~1 s of idle time at 50 ms a micro-step: most of it trains
    assert report.micro_steps >= 0.7 * SLOW_RANK_SECONDS / MICRO_STEP_SECONDS
    assert report.tokens == 128 * report.micro_steps
    assert abs(fast["training"] - report.training_seconds) < 1e-9 and fast["training"] > 0.7 * SLOW_RANK_SECONDS
    latency = report.released_at - fast["slowest_done"]
    assert 0 <= latency < MICRO_STEP_SECONDS + 0.03, latency  # preempted within one micro-step
    # the slowest rank has no idle time to use: it starts no drafter step and is released at once
    assert slow["report"].micro_steps == 0 and slow["report"].released_at - slow["slowest_done"] < MICRO_STEP_SECONDS + 0.03
    assert not report.failed


def test_a_failing_drafter_step_is_logged_and_the_rank_waits_idle_instead():
    results = run_on_ranks(_rollout_with_spot_training, 2, 3, 1.0)
    report = results[0]["report"]
    assert report.failed and report.micro_steps == 2  # two good steps, the third raised, none after
    assert results[0]["calls"] == 3
    assert report.released_at >= results[0]["slowest_done"]
    assert results[0]["idle"] > 0.5 * SLOW_RANK_SECONDS  # the rest of the wait is idle


def test_a_duty_cycle_below_one_rests_between_micro_steps_in_proportion():
    results = run_on_ranks(_rollout_with_spot_training, 2, None, 0.25)
    fast = results[0]
    share = fast["training"] / (fast["training"] + fast["idle"])
    assert 0.15 < share < 0.32, share  # a quarter of the idle time trains, the rest rests
    assert fast["report"].micro_steps >= 3
    latency = fast["report"].released_at - fast["slowest_done"]
    assert 0 <= latency < MICRO_STEP_SECONDS + 0.03, latency  # resting does not delay the release
