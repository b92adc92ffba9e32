"""Where rank 0's step scalars go (``trainer.loggers``): TensorBoard, Weights & Biases, or both.

Every sink takes the same ``log(metrics, step)`` and gets the same floats: ``scalar_metrics`` flattens a
summary record once (a list of numbers, one per rank, becomes ``key/rank0``, ``key/rank1``, ...), and
``MetricLoggers`` hands that one dict to each sink.

    RUN_DIR/tensorboard/       SummaryWriter event files
    RUN_DIR/wandb/             wandb's run files (offline by default: `wandb sync` uploads them later)
    RUN_DIR/wandb/tlt_run_id   the wandb run id, so a resumed run logs to the same wandb run
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from megatron_tlt.atomic_files import write_text_atomic
from megatron_tlt.config import TLTConfig
from megatron_tlt.rl.run import samples_log

TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
WANDB_RUN_ID_FILE = "tlt_run_id"


class MetricSink(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def log_samples(self, records: list[dict], step: int) -> None:
        """A few of the step's samples (``samples_log.sample_records``) as text."""

    def close(self) -> None: ...


def scalar_metrics(record: dict) -> dict[str, float]:
    """A summary record's scalars: numbers (booleans as 0/1) under their key, each number of a list of
    numbers (one per rank) under ``key/rankN``; the step, strings and dicts are left out."""
    metrics = {}
    for key, value in record.items():
        if isinstance(value, (int, float)) and key != "step":
            metrics[key] = float(value)
        elif isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
            for rank, v in enumerate(value):
                metrics[f"{key}/rank{rank}"] = float(v)
    return metrics


class TensorBoardSink:
    def __init__(self, run_dir: Path, *, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops events a killed run wrote past the checkpoint we resume from.
        self.writer = SummaryWriter(str(run_dir / TENSORBOARD_DIR), purge_step=start_step + 1 if start_step else None)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_samples(self, records: list[dict], step: int) -> None:
        self.writer.add_text("samples", samples_log.as_markdown(records), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A wandb run in ``RUN_DIR/wandb``, offline unless ``trainer.wandb_mode=online``. A resumed run reuses
    the run id (``resume="allow"``): offline, each process writes a fragment that ``wandb sync`` joins into
    one run; online, wandb drops the steps a killed run had already logged past its checkpoint (wandb's
    steps only increase), which TensorBoard's purge_step replaces instead. A killed process loses what
    wandb had not yet flushed to its run file (it flushes every 15 s); TensorBoard's events are flushed
    every step."""

    def __init__(self, run_dir: Path, config: TLTConfig):
        import wandb

        id_file = run_dir / WANDB_DIR / WANDB_RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else None  # None: wandb picks a new one
        t = config.trainer
        self.run = wandb.init(project=t.wandb_project, name=t.wandb_name or run_dir.name, dir=str(run_dir),
                              mode=t.wandb_mode, id=run_id, resume="allow", config=dataclasses.asdict(config))
        if run_id is None:
            write_text_atomic(id_file, self.run.id + "\n")

    def log(self, metrics: dict[str, float], step: int) -> None:
        # commit: a step's metrics arrive in one call; without it wandb holds a step back until the next one
        self.run.log(metrics, step=step, commit=True)

    def log_samples(self, records: list[dict], step: int) -> None:
        import wandb

        table = wandb.Table(columns=["step", "prompt", "response", "reward", "tokens"],
                            data=[[r["step"], r["prompt"], r["response"], r["reward"], r["response_tokens"]]
                                  for r in records])
        self.run.log({"samples": table}, step=step, commit=False)  # the step's scalars commit it

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() may return before wandb's service process has written the last records to the run file,
        # and the atexit hook that waits for it is unreliable in processes that multiprocessing started
        # (our ranks): teardown waits for the service to end.
        wandb.teardown()


class MetricLoggers:
    """The sinks ``trainer.loggers`` names, fed the same metrics."""

    def __init__(self, sinks: list[MetricSink]):
        self.sinks = sinks

    def log(self, metrics: dict[str, float], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def log_samples(self, records: list[dict], step: int) -> None:
        for sink in self.sinks:
            sink.log_samples(records, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


# trainer.loggers' names (config.LOGGERS, which the config checks names against) -> how to open each sink
SINK_OPENERS: dict[str, Callable[[TLTConfig, Path, int], MetricSink]] = {
    "tensorboard": lambda config, run_dir, start_step: TensorBoardSink(run_dir, start_step=start_step),
    "wandb": lambda config, run_dir, start_step: WandbSink(run_dir, config),
}


def open_metric_loggers(config: TLTConfig, run_dir: Path, *, start_step: int) -> MetricLoggers:
    """Open the sinks ``trainer.loggers`` names, in its order."""
    return MetricLoggers([SINK_OPENERS[name](config, run_dir, start_step) for name in config.trainer.loggers])
