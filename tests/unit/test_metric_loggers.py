"""trainer.loggers: TensorBoard and wandb (offline, no network) get the same scalars through one interface."""

from __future__ import annotations

import pytest

from megatron_tlt.config import LOGGERS, ConfigError, load_config
from megatron_tlt.rl.run.metric_loggers import (
    SINK_OPENERS,
    WANDB_DIR,
    WANDB_RUN_ID_FILE,
    open_metric_loggers,
    scalar_metrics,
)

RECORDS = [
    {"step": 1, "reward_mean": 0.25, "rollout_idle_share": [0.125, 0.0], "drafter/failed": False,
     "spec/engine_steps_by_depth": {"0": 3}, "note": "left out", "rollout_idle_seconds": []},
    {"step": 2, "reward_mean": 0.5, "rollout_idle_share": [0.25, 0.0625], "drafter/failed": True},
]


@pytest.fixture
def offline_wandb(monkeypatch):
    """wandb as the tests run it: offline and silent, and any attempt at the network sent to a closed local
    port, so that a run that needed it could not pass."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_BASE_URL", "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def test_a_record_s_scalars_are_its_numbers_and_one_per_rank_of_its_lists():
    assert scalar_metrics(RECORDS[0]) == {"reward_mean": 0.25, "rollout_idle_share/rank0": 0.125,
                                          "rollout_idle_share/rank1": 0.0, "drafter/failed": 0.0}


def test_every_logger_name_the_config_accepts_opens_a_sink():
    assert sorted(SINK_OPENERS) == sorted(LOGGERS)


def test_the_loggers_default_to_tensorboard_and_wandb_to_offline():
    trainer = load_config("tiny").trainer
    assert trainer.loggers == ["tensorboard"] and trainer.wandb_mode == "offline"
    assert load_config("tiny", ["trainer.loggers=[tensorboard,wandb]"]).trainer.loggers == ["tensorboard", "wandb"]
    assert load_config("tiny", ["trainer.loggers=[]"]).trainer.loggers == []


@pytest.mark.parametrize("override, message", [
    ("trainer.loggers=[tensorboard,wandbb]",
     "the command line: trainer.loggers[1] must be one of tensorboard, wandb, got 'wandbb'"),
    ("trainer.loggers=[wandb,wandb]", "trainer.loggers lists 'wandb' more than once"),
    ("trainer.wandb_mode=cloud", "the command line: trainer.wandb_mode must be one of offline, online, got 'cloud'"),
])
def test_bad_logger_settings_are_one_line_config_errors(override, message):
    with pytest.raises(ConfigError) as info:
        load_config("tiny", [override])
    assert str(info.value) == message


def _tensorboard_scalars(log_dir) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    steps: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            steps.setdefault(event.step, {})[tag] = event.value
    return steps


def test_tensorboard_and_an_offline_wandb_run_receive_the_same_metrics(tmp_path, offline_wandb, wandb_offline_history):
    config = load_config("tiny", ["trainer.loggers=[tensorboard,wandb]", "trainer.wandb_name=unit"])
    loggers = open_metric_loggers(config, tmp_path, start_step=0)
    loggers.log(scalar_metrics({"eval/greedy_accuracy": 0.375}), 0)
    for record in RECORDS:
        loggers.log(scalar_metrics(record), record["step"])
    loggers.close()

    want = {0: {"eval/greedy_accuracy": 0.375}} | {r["step"]: scalar_metrics(r) for r in RECORDS}
    (run_id, history), = wandb_offline_history(tmp_path / WANDB_DIR)
    assert (tmp_path / WANDB_DIR / WANDB_RUN_ID_FILE).read_text().strip() == run_id and history == want
    assert _tensorboard_scalars(tmp_path / "tensorboard") == want  # the values are exact in float32 too


def test_a_resumed_run_logs_to_the_same_wandb_run(tmp_path, offline_wandb, wandb_offline_history):
    config = load_config("tiny", ["trainer.loggers=[wandb]"])
    first = open_metric_loggers(config, tmp_path, start_step=0)
    first.log({"reward_mean": 0.25}, 1)
    first.close()
    run_id = (tmp_path / WANDB_DIR / WANDB_RUN_ID_FILE).read_text().strip()
    second = open_metric_loggers(config, tmp_path, start_step=1)
    second.log({"reward_mean": 0.5}, 2)
    second.close()
    runs = wandb_offline_history(tmp_path / WANDB_DIR)
    # two offline fragments of one run id, which `wandb sync` joins in start order
    assert runs == [(run_id, {1: {"reward_mean": 0.25}}), (run_id, {2: {"reward_mean": 0.5}})]
    assert not (tmp_path / "tensorboard").exists()  # only the loggers named


def test_a_steps_samples_reach_tensorboard_as_text_and_wandb_as_a_table(tmp_path, offline_wandb, wandb_offline_history):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = load_config("tiny", ["trainer.loggers=[tensorboard,wandb]"])
    loggers = open_metric_loggers(config, tmp_path, start_step=0)
    records = [{"step": 1, "prompt": "Q: 2+3=?", "response": "5", "reward": 1.0, "finish_reason": "stop",
                "response_tokens": 1}]
    loggers.log_samples(records, 1)
    loggers.log({"reward_mean": 1.0}, 1)  # the step's scalars commit the wandb step
    loggers.close()

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    (text,) = events.Tensors("samples/text_summary")
    assert text.step == 1 and "| Q: 2+3=? | 5 | 1 | 1 (stop) |" in text.tensor_proto.string_val[0].decode()
    ((_, history),) = wandb_offline_history(tmp_path / WANDB_DIR)
    assert history[1]["reward_mean"] == 1.0  # wandb logs a table as a file beside the run: its rows and columns here
    assert history[1]["samples/_type"] == "table-file" and history[1]["samples/nrows"] == 1
