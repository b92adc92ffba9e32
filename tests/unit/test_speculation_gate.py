"""A new run speculates only with a drafter whose ceiling reaches speculation.min_ceiling
(commands/speculation_gate.py): below it the run's engines roll out without drafts, it says so, and its
config.yaml records drafter.depth 0."""

import json
import shutil
from pathlib import Path

import pytest

from megatron_tlt.commands import speculation_gate, start
from megatron_tlt.config import load_config
from megatron_tlt.config.checks import ConfigError
from megatron_tlt.drafter import store
from megatron_tlt.rl.run import run_dir as run_files
from megatron_tlt.rl.task_source import task_source

# accepted about as SmolLM2-135M's cheap cold start was at temperature 1 (bench/RESULTS.md), on the tiny policy,
# whose drafter costs 2.45% of a policy token where SmolLM2's costs 24%
WEAK = [0.30, 0.10, 0.05, 0.02]
SHIPPED = next((Path(start.__file__).parents[1] / "rl" / "tiny" / "shipped").glob("drafter-*"))
# the tiny default's shipped cold start
STRONG = [0.85, 0.91, 0.91, 0.91]


def _drafter_dir(tmp_path, acceptance):
    directory = tmp_path / "drafter"
    directory.mkdir(parents=True)
    # the tiny default's shipped cold-start weights: drafter.init_dir must hold a drafter; only its record differs
    shutil.copy(SHIPPED / store.WEIGHTS_FILE, directory / store.WEIGHTS_FILE)
    info = {} if acceptance is None else {speculation_gate.ACCEPTANCE_KEY: acceptance}
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
    assert _judge(_config(weak_dir, "speculation.min_ceiling=0")).serve
    # judged at the depths the run drafts: one draft of the middling drafter, (1 + 0.30) / (1 + 0.0245)
    assert _judge(_config(middling_dir, "drafter.depth=1")).ceiling.speedup == pytest.approx(1.30 / 1.0245, abs=2e-3)
    assert not _judge(_config(middling_dir, "speculation.min_ceiling=1.5")).serve


def test_a_drafter_that_records_no_held_out_acceptance_is_served_as_configured(tmp_path):
    for name, acceptance in (("none", None), ("nan", [float("nan"), float("nan")])):
        verdict = _judge(_config(_drafter_dir(tmp_path / name, acceptance)))
        assert verdict.serve and verdict.ceiling is None
        assert "records no held-out acceptance" in verdict.describe()


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
    # one that can pay changes nothing and says why
    served = _config(_drafter_dir(tmp_path / "strong", STRONG))
    depth = served.drafter.depth
    start._judge_speculation(served, run_dir, writer=False)  # a rank that is not the writer: silent
    assert served.drafter.depth == depth > 0 and capsys.readouterr().out == ""
    start._judge_speculation(served, run_dir, writer=True)
    assert capsys.readouterr().out.startswith("speculation: on; the starting drafter's ceiling")
    assert run_files.speculation_verdict_fields(run_dir)["spec/served"] is True
