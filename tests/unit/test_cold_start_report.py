"""What a run says of its drafter's cold start: where the drafter came from (made by this run, the cache, the
package), the line before a warm-up starts, and its wall time in the first step's record of summary.json."""

import json
import time
from pathlib import Path

import pytest

from megatron_tlt.commands import start
from megatron_tlt.commands.start import ColdStart, obtain_cold_start
from megatron_tlt.config import load_config
from megatron_tlt.rl.run import run_dir as run_files
from megatron_tlt.rl.run.metric_loggers import MetricLoggers

FIGURES = {"tokens_trained": 100, "train_prompts": 18, "eval_prompts": 6, "epochs": 2, "eval_depth": 2,
           "held_out_top1_agreement_before": 0.25, "held_out_top1_agreement_after": 0.5,
           "held_out_loss_before": 2.0, "held_out_loss_after": 1.0,
           "held_out_acceptance_length_before": 1.5, "held_out_acceptance_length_after": 2.25,
           "held_out_acceptance_by_position_after": [0.75, 0.5]}


def test_the_tiny_defaults_cold_start_comes_from_the_package_then_from_the_cache_and_costs_no_time(tmp_path, capsys):
    overrides = [f"warmup.cache_dir={tmp_path}"]
    first = obtain_cold_start("tiny", overrides, make=False)  # nothing is launched: make=False would raise
    second = obtain_cold_start("tiny", overrides, make=False)
    assert (first.source, first.seconds, first.figures) == ("package", 0.0, None)
    assert (second.source, second.seconds, second.directory) == ("cache", 0.0, first.directory)
    assert capsys.readouterr().out == ""  # no warm-up, nothing to announce


def _stand_in_warm_up(launched: dict, figures: dict):
    def warm_up(config_name, overrides, *, policy, out_dir, log_dir, announce):
        """Stands in for the launch of the warm-up's ranks (tests/dist/test_rl_trainer.py runs the real one)."""
        launched.update(out_dir=out_dir, settings=load_config(config_name, overrides).drafter.cold_start,
                        log_dir=log_dir, before=announce + "\n")
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "model.safetensors").write_bytes(b"")
        time.sleep(0.05)
        return figures
    return warm_up


def test_a_cold_start_the_run_makes_says_what_it_does_and_why_first_and_what_it_took_after(tmp_path, capsys,
                                                                                            monkeypatch):
    overrides = [f"warmup.cache_dir={tmp_path}", "warmup.use_shipped=false"]
    launched = {}
    monkeypatch.setattr(start, "start_drafter_warmup", _stand_in_warm_up(launched, FIGURES))
    made = obtain_cold_start("tiny", overrides)
    settings = load_config("tiny", overrides).drafter.cold_start
    # the tiny policy's drafter costs 1/40.8 of it a token: (1 + 0.75 + 0.375) / (1 + 2 x 0.0245) at depth 2
    ceiling = {"speculation_ceiling": pytest.approx(2.026, abs=1e-3), "speculation_ceiling_depth": 2}
    assert made.source == "made" and made.figures == {**FIGURES, **ceiling} and made.seconds >= 0.05
    assert launched["out_dir"] == str(made.directory) and launched["settings"] == settings
    # outside a run its ranks log beside the cache entry (`tlt train` passes RUN_DIR/logs/cold_start)
    assert launched["log_dir"] == made.directory.with_name(made.directory.name + ".logs")
    assert launched["before"] == (
        f"cold start: no drafter cached for this policy and config, so one is distilled from the initial policy "
        f"before RL (its responses to up to {settings.prompts} prompts, then {settings.epochs} epochs of training); "
        f"made once, cached in {made.directory}; logs in {launched['log_dir']}\n")
    assert capsys.readouterr().out == ("cold start: done in 0.0 min; held-out top-1 agreement with the policy 0.250 -> "
                                       "0.500, acceptance length at depth 2 (teacher-forced) 1.50 -> 2.25; "
                                       "speculation's ceiling with this drafter 2.03x at depth 2 (verifying free, a "
                                       "draft token 2% of a policy token)\n")
    assert obtain_cold_start("tiny", overrides, make=False).source == "cache"  # the next run's


def test_a_cold_start_records_its_ceiling_and_leaves_the_verdict_to_the_run(tmp_path, capsys, monkeypatch):
    weak = {**FIGURES, "held_out_acceptance_by_position_after": [0.05, 0.02]}
    monkeypatch.setattr(start, "start_drafter_warmup", _stand_in_warm_up({}, weak))
    made = obtain_cold_start("tiny", [f"warmup.cache_dir={tmp_path}", "warmup.use_shipped=false"])
    assert made.figures["speculation_ceiling"] == pytest.approx(1.05 / 1.0245, abs=1e-3)
    # whether the run speculates with it is the run's call (commands/speculation_gate.py), said there once
    out = capsys.readouterr().out.splitlines()
    assert "ceiling with this drafter 1.02x at depth 1" in out[-1] and "WARNING" not in "\n".join(out)
    # no chain long enough to measure (NaN): no ceiling, and the run goes on
    unmeasured = {**FIGURES, "held_out_acceptance_by_position_after": [float("nan"), float("nan")]}
    monkeypatch.setattr(start, "start_drafter_warmup", _stand_in_warm_up({}, unmeasured))
    made = obtain_cold_start("tiny", [f"warmup.cache_dir={tmp_path / 'nan'}", "warmup.use_shipped=false"])
    assert "speculation_ceiling" not in made.figures
    # a chain that reached the 1st position only: the ceiling of what was measured, as the run judges it
    partial = {**FIGURES, "held_out_acceptance_by_position_after": [0.5, float("nan")]}
    monkeypatch.setattr(start, "start_drafter_warmup", _stand_in_warm_up({}, partial))
    made = obtain_cold_start("tiny", [f"warmup.cache_dir={tmp_path / 'partial'}", "warmup.use_shipped=false"])
    assert (made.figures["speculation_ceiling"], made.figures["speculation_ceiling_depth"]) == (
        pytest.approx(1.5 / 1.0245, abs=1e-3), 1)


def _reporter(run_dir, start_step=0):
    return run_files.RunReporter(run_dir, total_steps=4, start_step=start_step, records=[], loggers=MetricLoggers([]))


def _record(step: int) -> dict:
    return {"step": step, "reward_mean": 0.5, "accuracy": 0.25, "response_length_mean": 30.0,
            "rollout_idle_share_mean": 0.2}


def test_the_first_steps_record_carries_the_cold_starts_wall_time_and_source(tmp_path):
    made = ColdStart(tmp_path / "drafter-0123", "made", 1143.5, FIGURES)
    (tmp_path / run_files.COLD_START_FILE).write_text(made.to_json())
    reporter = _reporter(tmp_path)
    reporter.log_step(_record(1), [])
    reporter.log_step(_record(2), [])
    reporter.close()
    first, second = run_files.read_summary(tmp_path)
    assert first["drafter/cold_start_seconds"] == 1143.5 and first["drafter/cold_start_source"] == "made"
    assert not any(key.startswith("drafter/cold_start") for key in second)
    assert json.loads((tmp_path / run_files.COLD_START_FILE).read_text())["figures"] == FIGURES


def test_a_drafter_from_the_cache_reports_no_time_and_a_resumed_or_cold_start_free_run_reports_nothing(tmp_path):
    cached, resumed, without = tmp_path / "cached", tmp_path / "resumed", tmp_path / "without"
    for run_dir in (cached, resumed):
        run_dir.mkdir()
        (run_dir / run_files.COLD_START_FILE).write_text(ColdStart(tmp_path / "drafter-0123", "cache").to_json())
    without.mkdir()
    for run_dir, start_step in ((cached, 0), (resumed, 2), (without, 0)):
        reporter = _reporter(run_dir, start_step)
        reporter.log_step(_record(start_step + 1), [])
        reporter.close()
    assert {k: v for k, v in run_files.read_summary(cached)[0].items() if "cold_start" in k} == {
        "drafter/cold_start_source": "cache", "drafter/cold_start_seconds": 0.0}
    for run_dir in (resumed, without):
        assert not any("cold_start" in key for key in run_files.read_summary(run_dir)[0])
