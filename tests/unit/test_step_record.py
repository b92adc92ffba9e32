"""The step's summary record from the ranks' reports: response lengths, the acceptance probe's fields and the
reward pool's."""

import dataclasses

from megatron_tlt.rl.run.step_record import RankStepReport, RewardPoolReport, step_record
from megatron_tlt.spec.metrics import SpecDecodeStats
from megatron_tlt.timeline.spans import BUSY, RankTimeline


def _report(rank: int, probe: SpecDecodeStats | None = None, alarm: bool = False,
            spec: SpecDecodeStats | None = None) -> RankStepReport:
    timeline = RankTimeline(rank)
    for start, phase in enumerate(("rollout", "reward", "logprob", "update", "sync")):
        timeline.add(phase, BUSY, float(start), start + 1.0)
    return RankStepReport(timeline=timeline, rewards=[1.0, 0.0], correct=[True, False], lengths=[3, 5],
                          truncated=[False, False], dropped_groups=0, spec=spec, step_depths=[], bandit=None,
                          tail=None, hidden_tokens=0, probe=probe, alarm=alarm)


def _record(*reports: RankStepReport) -> dict:
    return step_record(1, list(reports), update={}, sync_gb_s=1.0, step_seconds=5.0)


def test_the_probe_pools_every_engines_drafts_and_counts_the_engines_that_raised_the_alarm():
    healthy = SpecDecodeStats(num_drafts=10, num_draft_tokens=30, num_accepted_tokens=15)
    lost = SpecDecodeStats(num_drafts=10, num_draft_tokens=30, num_accepted_tokens=0)
    # rank 1 is a follower of rank 0's engine: it reports no probe of its own
    record = _record(_report(0, healthy), _report(1), _report(2, lost, alarm=True))
    assert record["spec/probe_acceptance_rate"] == 15 / 60
    assert record["spec/acceptance_alarms"] == 1


def test_without_a_probe_the_record_has_no_probe_fields():
    record = _record(_report(0), _report(1))
    assert "spec/probe_acceptance_rate" not in record and "spec/acceptance_alarms" not in record


def test_a_rollout_whose_drafts_were_rejected_counts_an_alarm_without_any_probe():
    drafted = SpecDecodeStats(num_drafts=10, num_draft_tokens=30, num_accepted_tokens=0)
    record = _record(_report(0, spec=drafted, alarm=True), _report(1, spec=drafted))
    assert record["spec/acceptance_alarms"] == 1 and "spec/probe_acceptance_rate" not in record
    healthy = SpecDecodeStats(num_drafts=10, num_draft_tokens=30, num_accepted_tokens=12)
    assert _record(_report(0, spec=healthy))["spec/acceptance_alarms"] == 0  # speculated, no alarm: a zero
    assert "spec/acceptance_alarms" not in _record(_report(0, spec=SpecDecodeStats()))  # speculation off


def test_response_lengths_pool_every_ranks_samples():
    record = _record(_report(0), _report(1))  # lengths 3 and 5 on each rank
    assert (record["response_length_median"], record["response_length_mean"], record["response_length_max"]) == (4, 4, 5)


def test_the_reward_pools_failures_are_counted_per_reason_and_its_overlap_pooled_over_ranks():
    record = _record(
        dataclasses.replace(_report(0), reward_pool=RewardPoolReport(scored=2, scored_in_rollout=2,
                                                                     failures={"timeout": 1})),
        dataclasses.replace(_report(1), reward_pool=RewardPoolReport(scored=2, scored_in_rollout=0,
                                                                     failures={"worker_crash": 1, "timeout": 1})))
    assert (record["reward/timeouts"], record["reward/worker_crashes"], record["reward/errors"]) == (2, 1, 0)
    assert record["reward/scored_in_rollout_share"] == 0.5
    assert not [key for key in _record(_report(0), _report(1)) if key.startswith("reward/")]  # scored inline


def _engine(rank: int, busy: float, estimate: float | None, drafts: int = 10) -> RankStepReport:
    report = _report(rank, spec=SpecDecodeStats(num_drafts=drafts, num_draft_tokens=3 * drafts,
                                                 num_accepted_tokens=2 * drafts))
    report.timeline = RankTimeline(rank)
    report.timeline.add("rollout", BUSY, 0.0, busy)
    return dataclasses.replace(report, speedup_estimate=estimate)


def test_the_rollouts_speedup_estimate_is_the_slowest_engines_depth0_time_over_the_phase():
    """At depth 0 the phase would have lasted as long as the longest of busy x estimate: 2 s x 1.5 against 1 s x 2.5."""
    record = _record(_engine(0, busy=2.0, estimate=1.5), _engine(1, busy=1.0, estimate=2.5))
    assert record["spec/rollout_speedup_vs_depth0"] == max(2.0 * 1.5, 1.0 * 2.5) / 2.0
    # an engine that drafted without an estimate leaves the field out; one that never drafted counts as 1x
    assert "spec/rollout_speedup_vs_depth0" not in _record(_engine(0, 2.0, 1.5), _engine(1, 1.0, None))
    assert _record(_engine(0, 1.0, 1.5), _engine(1, 2.0, None, drafts=0))["spec/rollout_speedup_vs_depth0"] == 1.0


def test_acceptance_pools_every_engines_drafts_not_their_rates():
    busy = SpecDecodeStats(num_drafts=30, num_draft_tokens=120, num_accepted_tokens=90,  # length 4.0, rate 0.75
                           accepted_per_position=(30, 30, 20, 10))
    idle = SpecDecodeStats(num_drafts=10, num_draft_tokens=40, num_accepted_tokens=10,  # length 2.0, rate 0.25
                           accepted_per_position=(6, 4))
    record = _record(_report(0, spec=busy), _report(1, spec=idle))
    assert record["spec/mean_acceptance_length"] == 1 + 100 / 40  # not the mean of 4.0 and 2.0
    assert record["spec/acceptance_rate"] == 100 / 160
    assert record["spec/acceptance_per_position"] == [36 / 40, 34 / 40, 20 / 40, 10 / 40]  # pooled drafts too
    assert "spec/mean_acceptance_length" not in _record(_report(0, spec=SpecDecodeStats()))  # speculation off


def test_a_step_whose_drafter_trained_names_its_precision_and_why_and_keeps_them_out_of_the_scalars():
    from megatron_tlt.drafter.spot import SpotReport
    from megatron_tlt.drafter.tlt_drafter import TailReport
    from megatron_tlt.rl.run.metric_loggers import scalar_metrics

    stats = {"loss": 1.0, "top1_agreement": 0.5, "tokens": 10.0, "dropped_steps": 0, "buffer_tokens": 20}
    why = "auto: torchao measured 1.40x bf16 in eager mode on NVIDIA H200 (2026-12-01), >= 1.05x: fp8 (torchao)"
    trained = [dataclasses.replace(_report(rank), tail=TailReport(spot=SpotReport(micro_steps=1, tokens=10),
                                                                  stats=stats, precision="fp8 (torchao)",
                                                                  precision_reason=why))
               for rank in range(2)]
    record = _record(*trained)
    assert (record["drafter/precision"], record["drafter/precision_reason"]) == ("fp8 (torchao)", why)
    assert not any(key.startswith("drafter/precision") for key in scalar_metrics(record))
    assert "drafter/precision" not in _record(_report(0), _report(1))  # no drafter trained: no drafter fields


def test_drafter_integrity_fields_count_each_engines_checks_of_the_step_and_time_the_slowest():
    from megatron_tlt.spec.drafter_integrity import IntegrityReport

    broken = IntegrityReport(checks=3, mismatches=2, failures=1, seconds=0.004, speculation_suspended=True)
    fine = IntegrityReport(checks=2, seconds=0.002)
    # rank 1 follows rank 0's engine and reports none
    record = _record(dataclasses.replace(_report(0), integrity=broken), _report(1),
                     dataclasses.replace(_report(2), integrity=fine))
    assert (record["spec/drafter_integrity_failures"], record["spec/drafter_integrity_mismatches"],
            record["spec/drafter_integrity_seconds"], record["spec/speculation_suspended"]) == (1, 2, 0.004, 1)
    assert not any(key.startswith("spec/drafter_integrity") for key in _record(_report(0)))  # checks off


def test_the_drafters_held_out_measure_is_reported_once_its_cost_as_the_slowest_ranks_and_on_the_tlt_line():
    from megatron_tlt.drafter.quality import AcceptanceTally
    from megatron_tlt.drafter.serving import QualityReport
    from megatron_tlt.rl.run.run_dir import tlt_line

    def tally(length: float) -> AcceptanceTally:  # 10 chains of expected length `length` at depth 2
        return AcceptanceTally(2, [9.0, 8.0], length_sum=10 * length, chains=10, entropy_sum=8.0, entropy_rows=10)

    quality = QualityReport(depth=2, serving=tally(2.5), cold_start=tally(2.25), candidate=tally(2.0), pushed=False,
                            pushes=3, declined=1, seconds=0.02)
    record = _record(dataclasses.replace(_report(0), quality=quality),
                     dataclasses.replace(_report(1), quality=dataclasses.replace(quality, seconds=0.05)))
    assert record["drafter/quality/expected_acceptance_length"] == 2.5
    assert record["drafter/quality/cold_start_expected_acceptance_length"] == 2.25
    assert record["drafter/quality/acceptance_by_position"] == {"1": 0.9, "2": 0.8}
    assert record["drafter/quality/policy_entropy"] == 0.8
    assert record["drafter/quality/seconds"] == 0.05
    assert (record["drafter/pushes"], record["drafter/pushes_declined"], record["drafter/pushed"]) == (3, 1, False)
    assert tlt_line(record) == ("step 1 TLT: drafter 2.50 vs cold start 2.25 at depth 2 (held out), entropy 0.80, "
                                "trained 2.00 declined")
    assert not any(key.startswith("drafter/") for key in _record(_report(0)))  # measure off: no fields


def test_the_spot_trainers_cost_to_the_generating_rank_is_measured_like_with_like_and_named_on_the_tlt_line():
    from megatron_tlt.drafter.neighbour_slowdown import EngineStep
    from megatron_tlt.rl.run.run_dir import tlt_line
    from megatron_tlt.timeline.spans import TRAINING

    # rank 1 generates 8 steps of batch 4 at depth 3: 0.10 s each while rank 0 rests, 0.11 s while it trains
    steps, start = [], 10.0
    for k in range(8):
        seconds = 0.11 if k % 2 else 0.10
        steps.append(EngineStep(start, seconds, 4, 3))
        start += seconds
    trainer = _report(0)
    for step in steps[1::2]:
        trainer.timeline.add("rollout", TRAINING, step.started_at, step.started_at + step.seconds)
    record = _record(trainer, dataclasses.replace(_report(1), engine_steps=steps))
    assert abs(record["drafter/neighbour_slowdown"] - 1.1) < 1e-9
    assert abs(record["drafter/spot_rollout_cost"] - (1 - 1 / 1.1) * 0.44 / 0.84) < 1e-9
    assert "spot training cost 4.8% of the generating rank's time" in tlt_line(record)
    # on another node rank 0's training costs rank 1 nothing: no estimate
    apart = step_record(1, [trainer, dataclasses.replace(_report(1), engine_steps=steps)], update={}, sync_gb_s=1.0,
                        step_seconds=5.0, ranks_per_node=1)
    assert apart["drafter/spot_rollout_cost"] is None
    assert "drafter/spot_rollout_cost" not in _record(_report(0), _report(1))  # nobody trained: no fields
