"""A new run speculates only with a drafter whose ceiling reaches speculation.min_ceiling
(commands/speculation_gate.py): below it the run's engines roll out without drafts, it says so, and its
config.yaml records drafter.depth 0."""

import json
import shutil
from pathlib import Path

import pytest

from megatron_tlt.commands import run_values, speculation_gate, start
from megatron_tlt.config import load_config
from megatron_tlt.config.checks import ConfigError
from megatron_tlt.drafter import store
from megatron_tlt.rl.run import run_dir as run_files
from megatron_tlt.rl.task_source import task_source

# a middling drafter on the tiny policy, whose draft token costs 2.45% of a policy token (SmolLM2-135M's: 24%)
WEAK = [0.30, 0.10, 0.05, 0.02]
SHIPPED = next((Path(start.__file__).parents[1] / "rl" / "tiny" / "shipped").glob("drafter-*"))
# the tiny default's shipped cold start
STRONG = [0.85, 0.91, 0.91, 0.91]


def _drafter_dir(tmp_path, acceptance, **measured_at):
    directory = tmp_path / "drafter"
    directory.mkdir(parents=True)
    # the tiny default's shipped cold-start weights: drafter.init_dir must hold a drafter; only its record differs
    shutil.copy(SHIPPED / store.WEIGHTS_FILE, directory / store.WEIGHTS_FILE)
    info = {} if acceptance is None else {speculation_gate.ACCEPTANCE_KEY: acceptance, **measured_at}
    (directory / store.INFO_FILE).write_text(json.dumps(info))
    return directory


def _config(drafter_dir, *overrides):
    return load_config("tiny", [f"drafter.init_dir={drafter_dir}", *overrides])


def _judge(config):
    return speculation_gate.judge(config, task_source(config).architecture())


def test_a_drafter_below_the_ceiling_is_not_served_and_one_above_it_is(tmp_path):
    middling_dir = _drafter_dir(tmp_path / "middling", WEAK)
    weak = _judge(_config(middling_dir))
    # the tiny drafter costs 2.45% of a policy token: (1 + 0.30 + 0.03) / (1 + 2 x 0.0245) at depth 2
    assert weak.ceiling.speedup == pytest.approx(1.33 / 1.049, abs=2e-3) and weak.ceiling.speedup > 1.1
    assert weak.serve  # 1.27x reaches the default's 1.1
    assert not _judge(_config(weak_dir := _drafter_dir(tmp_path / "weaker", [0.05, 0.02]))).serve
    strong = _judge(_config(_drafter_dir(tmp_path / "strong", STRONG)))
    assert strong.serve and strong.ceiling.speedup > 2.5
    # min_ceiling 0 serves any drafter; a higher bar turns a middling one off
    assert not _judge(_config(middling_dir, "speculation.min_ceiling=1.5")).serve
    assert _judge(_config(weak_dir, "speculation.min_ceiling=0")).serve
    # judged at the depths the run drafts: one draft of the middling drafter, (1 + 0.30) / (1 + 0.0245)
    assert _judge(_config(middling_dir, "drafter.depth=1")).ceiling.speedup == pytest.approx(1.30 / 1.0245, abs=2e-3)


def test_a_drafter_that_records_no_held_out_acceptance_is_served_as_configured(tmp_path):
    for name, acceptance in (("none", None), ("nan", [float("nan"), float("nan")])):
        verdict = _judge(_config(_drafter_dir(tmp_path / name, acceptance)))
        assert verdict.serve and verdict.ceiling is None
        assert "records no held-out acceptance" in verdict.describe()


def test_the_drafter_is_judged_at_the_depths_the_run_may_draft(tmp_path):
    directory = _drafter_dir(tmp_path / "one-good-draft", [0.9, 0.0])
    # BEG-MAB may pick depth 1, the best; a fixed depth 2 drafts a second token that is never accepted
    assert _judge(_config(directory, "drafter.depth=2")).ceiling.depth == 1
    fixed = _judge(_config(directory, "drafter.depth=2", "speculation.adaptive=false")).ceiling
    assert (fixed.depth, fixed.speedup) == (2, pytest.approx(1.9 / 1.049, abs=2e-3))
    arms = _judge(_config(directory, "drafter.depth=2", "speculation.depths=[0,2]")).ceiling
    assert arms.depth == 2
    # a fixed depth past the positions its record measured cannot be judged: served as configured
    unmeasured = _judge(_config(directory, "drafter.depth=4", "speculation.adaptive=false"))
    assert unmeasured.serve and unmeasured.ceiling is None


def test_only_the_measured_leading_positions_of_a_record_count(tmp_path):
    # NaN: no held-out chain reached the 2nd position; the 1st was measured and is judged
    partial = _judge(_config(_drafter_dir(tmp_path / "partial", [0.05, float("nan")])))
    assert not partial.serve and partial.ceiling.depth == 1
    for name, record in (("above-one", [1.5, 0.5]), ("null", [None, 0.5]), ("text", "0.9")):
        verdict = _judge(_config(_drafter_dir(tmp_path / name, record)))
        assert verdict.serve and verdict.ceiling is None, name


def test_a_record_measured_at_another_sampling_does_not_judge_the_run(tmp_path):
    run = load_config("tiny", [])  # the tiny default's sampling, as its cold start records it
    same = speculation_gate.measured_at(run)
    assert same == {"held_out_temperature": run.rollout.temperature, "held_out_draft_sampling": "probabilistic"}
    other = load_config("tiny", ["rollout.temperature=0.5", "speculation.draft_sampling=greedy"])
    assert speculation_gate.measured_at(other) == {"held_out_temperature": 0.5, "held_out_draft_sampling": "greedy"}
    weak = _judge(_config(_drafter_dir(tmp_path / "same", WEAK[2:], **same)))
    assert not weak.serve and weak.unjudged is None  # measured as the run samples: judged, and turned off
    # the same record measured at half the run's temperature, or with greedy drafts: served as configured, saying why
    for name, other in (("cooler", {"held_out_temperature": run.rollout.temperature / 2}),
                        ("greedy", {"held_out_draft_sampling": "greedy"})):
        verdict = _judge(_config(_drafter_dir(tmp_path / name, WEAK[2:], **{**same, **other})))
        assert verdict.serve and verdict.ceiling is None, name
        field, value = next(iter(other.items()))
        assert verdict.describe() == (
            f"speculation: on as configured (the starting drafter's held-out acceptance was measured at "
            f"{speculation_gate.RECORDED_AS[field]} {value} and this run has {speculation_gate.RECORDED_AS[field]} "
            f"{same[field]}; acceptance moves with sampling, so that record does not judge it)")
        assert json.loads(verdict.to_json())["unjudged"] == verdict.unjudged
    # a record that measured each draft sampling judges a run of either (a cached cold start serves both)
    both = {speculation_gate.BY_DRAFT_SAMPLING_KEY: {"greedy": WEAK[2:], "probabilistic": STRONG}}
    greedy_record = {**same, "held_out_draft_sampling": "greedy", **both}
    judged = _judge(_config(_drafter_dir(tmp_path / "both", WEAK[2:], **greedy_record)))
    assert judged.serve and judged.ceiling.speedup > 2.5  # by its probabilistic figures, not its greedy ones
    # a run at that temperature is judged by it
    cooler = _config(_drafter_dir(tmp_path / "cooler-run", WEAK[2:], **{**same, "held_out_temperature": 0.25}),
                     "rollout.temperature=0.25")
    assert not _judge(cooler).serve
    # greedy rollouts accept a draft alike however it was drawn: only the temperature counts there
    greedy = {"held_out_temperature": 0.0, "held_out_draft_sampling": "greedy"}
    assert not _judge(_config(_drafter_dir(tmp_path / "greedy-run", WEAK[2:], **greedy), "rollout.temperature=0")).serve
    # the shipped cold start names no sampling (it predates the fields): taken as it is
    shipped = _judge(_config(SHIPPED))
    assert "held_out_temperature" not in store.read_drafter_info(SHIPPED)
    assert shipped.serve and shipped.ceiling is not None and shipped.unjudged is None


def test_min_ceiling_is_checked():
    with pytest.raises(ConfigError, match="speculation.min_ceiling must be >= 0"):
        load_config("tiny", ["speculation.min_ceiling=-1"])
    with pytest.raises(ConfigError, match="speculation.min_ceiling must be >= 0"):
        load_config("tiny", ["speculation.min_ceiling=nan"])


def test_a_run_whose_drafter_cannot_pay_rolls_out_without_drafts_says_so_and_records_it(tmp_path, capsys):
    config = _config(_drafter_dir(tmp_path, [0.05, 0.02]), "drafter.spot_training=true")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    start._judge_speculation(config, run_dir, writer=True)
    assert config.drafter.depth == 0 and config.drafter.spot_training  # the drafter still trains on idle ranks
    out = capsys.readouterr().out
    assert out.startswith("speculation: OFF for this run: the starting drafter can make rollouts at most 1.02x faster")
    assert "speculation.min_ceiling 1.1" in out and "speculation.min_ceiling=0 speculates anyway" in out
    recorded = load_config(str(run_dir / run_files.CONFIG_FILE), [])
    assert recorded.drafter.depth == 0 and recorded.drafter.spot_training  # a resumed run stays so
    # the first step's record says so (RunReporter)
    assert run_files.speculation_verdict_fields(run_dir) == {
        "spec/served": False, "spec/drafter_ceiling": pytest.approx(1.05 / 1.0245, abs=1e-3)}
    # a resume that asks for drafts again decides the arms anew (the gate left them null)
    resumed = run_values.decided(load_config(str(run_dir / run_files.CONFIG_FILE), ["drafter.depth=1"]),
                                 run_name="run")
    assert resumed.speculation.depths == [0, 1]
    # a rank that is not the writer judges alike and writes nothing
    quiet_dir = tmp_path / "not-the-writer"
    quiet_dir.mkdir()
    quiet = _config(_drafter_dir(tmp_path / "also-weak", [0.05, 0.02]))
    start._judge_speculation(quiet, quiet_dir, writer=False)
    assert quiet.drafter.depth == 0 and not any(quiet_dir.iterdir()) and capsys.readouterr().out == ""
    # one that can pay changes nothing and says why
    served = _config(_drafter_dir(tmp_path / "strong", STRONG))
    depth = served.drafter.depth
    start._judge_speculation(served, run_dir, writer=False)
    assert served.drafter.depth == depth > 0 and capsys.readouterr().out == ""
    start._judge_speculation(served, run_dir, writer=True)
    assert capsys.readouterr().out.startswith("speculation: on; the starting drafter's ceiling")
    assert run_files.speculation_verdict_fields(run_dir)["spec/served"] is True
