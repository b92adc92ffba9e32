"""The run directory and what rank 0 reports into it.

    RUN_DIR/config.yaml        the resolved configuration (``tlt train --resume RUN_DIR`` reads it back)
    RUN_DIR/summary.json       one record per RL step (rewritten atomically after every step)
    RUN_DIR/eval_before_rl.json held-out accuracy of the starting policy
    RUN_DIR/cold_start.json    where the drafter's cold start came from, and its wall time if this run made it
    RUN_DIR/timeline.jsonl     every rank's BUSY/IDLE spans, one JSON object per span
    RUN_DIR/timeline.trace.json the same spans as a Chrome trace (Perfetto, chrome://tracing), rewritten each step
    RUN_DIR/timeline_last_step.png the last step's spans, a row per rank
    RUN_DIR/samples.jsonl      a few prompt / response / reward triples of each step (``samples_log.py``)
    RUN_DIR/tensorboard/, wandb/ scalars (``trainer.loggers``): reward, accuracy, lengths, phase times, idle share
    RUN_DIR/checkpoints/step_N/ atomic checkpoints (``rl/run/checkpoint.py``)
    RUN_DIR/logs/rank{N}.log   each rank's full output (``rank_logs.py``); the console keeps rank 0's
                               progress bar and RunReporter's lines, and every rank's errors
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from megatron_tlt.atomic_files import drop_steps_after, write_text_atomic
from megatron_tlt.rl.run import samples_log
from megatron_tlt.rl.run.metric_loggers import MetricLoggers, scalar_metrics
from megatron_tlt.timeline.plot import plot_step_timeline
from megatron_tlt.timeline.trace import write_chrome_trace

CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
TIMELINE_FILE = "timeline.jsonl"
TRACE_FILE = "timeline.trace.json"
TIMELINE_PLOT_FILE = "timeline_last_step.png"
EVAL_BEFORE_RL_FILE = "eval_before_rl.json"
COLD_START_FILE = "cold_start.json"
SPECULATION_VERDICT_FILE = "speculation_verdict.json"
LOG_DIR = "logs"


class RunDirError(ValueError):
    """A run directory that cannot be started or resumed as asked."""


def default_run_dir() -> str:
    return str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))


def prepare_new_run_dir(run_dir: Path, config_yaml: str) -> None:
    """Create ``run_dir`` for a new run; refuse one that already holds a run (``--resume`` continues it).
    Under torchrun the other ranks may have started their logs in it already."""
    if run_dir.exists() and any(p.name != LOG_DIR for p in run_dir.iterdir()):
        raise RunDirError(f"run directory {run_dir} already holds a run: continue it with "
                          f"`tlt train --resume {run_dir}`, or choose another trainer.run_dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / CONFIG_FILE, config_yaml)


def cold_start_fields(run_dir: Path) -> dict:
    """What the run's first step record says of the drafter's cold start (``cold_start.json``, written by
    ``commands/start.py``): ``drafter/cold_start_source`` (made, cache or package) and
    ``drafter/cold_start_seconds`` (its wall time if this run made it, else 0); nothing without a cold start."""
    path = run_dir / COLD_START_FILE
    if not path.is_file():
        return {}
    cold_start = json.loads(path.read_text())
    return {"drafter/cold_start_source": cold_start["source"], "drafter/cold_start_seconds": cold_start["seconds"]}


def speculation_verdict_fields(run_dir: Path) -> dict:
    """What the run's first step record says of the verdict on its starting drafter (``speculation_verdict.json``,
    ``commands/speculation_gate.py``): ``spec/served`` (whether the engines speculate with it) and
    ``spec/drafter_ceiling`` (None where the drafter could not be judged: no held-out acceptance at the run's depths
    and sampling; the verdict file says why); nothing where no drafter was judged (TLT off, a resumed run)."""
    path = run_dir / SPECULATION_VERDICT_FILE
    if not path.is_file():
        return {}
    verdict = json.loads(path.read_text())
    return {"spec/served": verdict["serve"], "spec/drafter_ceiling": verdict["ceiling"]}


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


class RunReporter:
    """Rank 0's outputs: summary.json, the timeline (jsonl, Chrome trace, PNG), the scalars of
    ``trainer.loggers`` and the progress bar."""

    def __init__(self, run_dir: Path, *, total_steps: int, start_step: int, records: list[dict],
                 loggers: MetricLoggers):
        from tqdm.auto import tqdm

        from megatron_tlt.rank_logs import console

        self.run_dir = run_dir
        self.records = records
        self.spans = read_timeline(run_dir)  # a resumed run's, already cut back to its checkpoint
        if self.spans:  # the trace of a killed run may hold the steps past that checkpoint
            write_chrome_trace(run_dir / TRACE_FILE, self.spans, run_name=run_dir.name)
        self._last_step_spans: list[dict] = []
        self._views_stale = False
        self.loggers = loggers
        self._first_step_fields = ({**cold_start_fields(run_dir), **speculation_verdict_fields(run_dir)}
                                   if start_step == 0 else {})
        self.console = console()  # the terminal, while the rank's own output goes to RUN_DIR/logs
        self.progress = tqdm(total=total_steps, initial=start_step, desc="RL steps", unit="step", dynamic_ncols=True,
                             file=self.console)

    def log_step(self, record: dict, timeline_records: list[dict], *, refresh_views: bool = True) -> None:
        """Append the step to summary.json, timeline.jsonl and the loggers; with ``refresh_views`` also rewrite
        the Chrome trace and the PNG. The trainer refreshes them at checkpoints only: rank 0 does this while
        the other ranks start the next rollout, which waits for it (the PNG took ~33 ms a step on 2 cores, and
        the trace grows with the run)."""
        step = record["step"]
        if self._first_step_fields:
            record, self._first_step_fields = {**record, **self._first_step_fields}, {}
        self.records.append(_json_safe(record))
        write_text_atomic(self.run_dir / SUMMARY_FILE, json.dumps(self.records, indent=1))
        with open(self.run_dir / TIMELINE_FILE, "a") as out:
            for span in timeline_records:
                out.write(json.dumps(span) + "\n")
        self.spans.extend(timeline_records)
        self._views_stale = True
        if timeline_records:
            self._last_step_spans = timeline_records
        if refresh_views:
            self.refresh_views()
        self.loggers.log(scalar_metrics(record), step)
        postfix = dict(reward=f"{record['reward_mean']:.3f}", acc=f"{record['accuracy']:.3f}",
                       len=f"{record['response_length_mean']:.0f}", idle=f"{100 * record['rollout_idle_share_mean']:.0f}%")
        self.progress.set_postfix(**postfix, refresh=False)
        for line in (tlt_line(record), eval_line(step, record)):
            if line is not None:
                self.progress.write(line, file=self.console)
        self.progress.update(1)

    def log_samples(self, step: int, records: list[dict]) -> None:
        """Before ``log_step`` of the same step (wandb commits the step with its scalars)."""
        if records:
            samples_log.append(self.run_dir, records)
            self.loggers.log_samples(records, step)

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Held-out accuracy at ``step``; step 0's (before RL) is also kept in its own file."""
        self.loggers.log(scalar_metrics(metrics), step)
        self.progress.write(eval_line(step, metrics), file=self.console)
        if step == 0:
            write_text_atomic(self.run_dir / EVAL_BEFORE_RL_FILE, json.dumps(metrics, indent=1))

    def refresh_views(self) -> None:
        """Rewrite timeline.trace.json (every span so far) and timeline_last_step.png (the latest step)."""
        if self._views_stale:
            write_chrome_trace(self.run_dir / TRACE_FILE, self.spans, run_name=self.run_dir.name)
            if self._last_step_spans:
                plot_step_timeline(self._last_step_spans, self.run_dir / TIMELINE_PLOT_FILE)
        self._views_stale = False

    def close(self) -> None:
        self.refresh_views()
        self.progress.close()
        self.loggers.close()


def eval_line(step: int, record: dict) -> str | None:
    """The console line of an evaluation: the record's held-out accuracies (None if it has none)."""
    metrics = {k: v for k, v in record.items() if k.startswith("eval/")}
    return f"step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()) if metrics else None


def tlt_line(record: dict) -> str | None:
    """The console line of TLT's step: acceptance of the speculative rollout, the share of the rollout's idle
    time the drafter trained in, the drafter's loss (None when neither speculation nor the drafter ran)."""
    parts = []
    if "spec/mean_acceptance_length" in record:
        parts.append(f"acceptance length {record['spec/mean_acceptance_length']:.2f} "
                     f"({100 * record['spec/acceptance_rate']:.0f}% of draft tokens)")
    if "spec/rollout_speedup_vs_depth0" in record:
        parts.append(f"rollout ~{record['spec/rollout_speedup_vs_depth0']:.2f}x its speed at depth 0 (estimated)")
    if "drafter/loss" in record:
        idle = sum(record["rollout_idle_seconds"])
        trained = sum(record["rollout_training_seconds"]) / idle if idle > 0 else 0.0
        loss = record["drafter/loss"]  # None (NaN) when no rank had tokens to train on
        parts.append(f"idle share trained {100 * trained:.0f}%, drafter loss "
                     + (f"{loss:.3f}" if loss is not None and math.isfinite(loss) else "-"))
    if record.get("drafter/spot_rollout_cost") is not None:
        parts.append(f"spot training cost {100 * record['drafter/spot_rollout_cost']:.1f}% of the generating rank's "
                     f"time at duty cycle {record.get('drafter/duty_cycle', 1.0):.2f}")
    if "drafter/quality/expected_acceptance_length" in record:
        parts.append(quality_phrase(record))
    if record.get("spec/acceptance_alarms"):
        parts.append(f"acceptance alarms {record['spec/acceptance_alarms']}")
    return f"step {record['step']} TLT: " + ", ".join(parts) if parts else None


def quality_phrase(record: dict) -> str:
    """The drafters' held-out measure, e.g. 'drafter 5.60 vs cold start 5.40 at depth 8 (held out), entropy 0.81,
    pushed'."""
    def length(key: str) -> str:
        value = record.get(key)
        return f"{value:.2f}" if value is not None and math.isfinite(value) else "-"

    phrase = (f"drafter {length('drafter/quality/expected_acceptance_length')} vs cold start "
              f"{length('drafter/quality/cold_start_expected_acceptance_length')} at depth "
              f"{record['drafter/quality/depth']} (held out), entropy {length('drafter/quality/policy_entropy')}")
    if "drafter/pushed" in record:
        candidate = length("drafter/quality/candidate_expected_acceptance_length")
        phrase += f", trained {candidate} " + ("pushed" if record["drafter/pushed"] else "declined")
    return phrase


def read_summary(run_dir: Path) -> list[dict]:
    path = run_dir / SUMMARY_FILE
    return json.loads(path.read_text()) if path.is_file() else []


def read_timeline(run_dir: Path) -> list[dict]:
    path = run_dir / TIMELINE_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []


def truncate_timeline(run_dir: Path, last_step: int) -> None:
    """Drop timeline spans of steps after ``last_step`` (written by a run killed after its checkpoint)."""
    drop_steps_after(run_dir / TIMELINE_FILE, last_step)
