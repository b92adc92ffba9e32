"""The parent process of the commands that launch ranks: resolve the config (and the run directory),
make the cached artifacts the ranks share, then launch the ranks. ``tlt train`` calls ``start_run``,
``tlt warmup-drafter`` ``start_drafter_warmup``, ``tlt bench rollout`` ``start_rollout_bench``.

Kept free of Megatron and vLLM imports: the parent process only prepares and launches; each rank
imports its command's module (``train.py``, ``warmup_drafter.py``, ``bench_rollout.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from megatron_tlt import atomic_files, layout_rules
from megatron_tlt.commands import run_values
from megatron_tlt.config import check_pretrained_config, load_config, to_yaml, world_size
from megatron_tlt.launcher import launched_rank
from megatron_tlt.rl.run import run_dir as run_files


def _train_on_rank(config, run_dir: str, resume: bool):
    from megatron_tlt.commands.train import train_on_rank  # imported in the rank: Megatron, vLLM

    return train_on_rank(config, run_dir, resume)


def _load(config_name: str | None, overrides: list[str], resume_dir: str | None):
    if resume_dir is None:
        return load_config(config_name, overrides)
    config_file = Path(resume_dir) / run_files.CONFIG_FILE
    if not config_file.is_file():
        raise run_files.RunDirError(f"{resume_dir}: not a run directory ({run_files.CONFIG_FILE} missing)")
    return load_config(str(config_file), overrides)


def _check_drafter_precision(config) -> None:
    """drafter.precision=fp8 where FP8 cannot run is refused here, saying why, before any rank starts (each
    rank's drafter checks again when it is built: ``drafter/precision.py``)."""
    from megatron_tlt.drafter.precision import check_runs_here  # torch only: no Megatron, no vLLM

    check_runs_here(config.drafter.precision)


def _check_layout(config) -> None:
    """Every layout rule of the run for the policy it will train (``layout_rules``, which tlt plan shares)."""
    from megatron_tlt.rl.task_source import task_source

    layout_rules.check_run_layout(config, task_source(config).architecture())


def _run_on_engine_ranks(fn, nprocs: int, *args, log_dir: Path | None = None) -> dict:
    """``fn`` on fresh rank processes that start vLLM engines (``launcher.run_on_ranks``); with ``log_dir``
    each rank's full output goes to ``log_dir/rank{N}.log`` and the console keeps progress and errors."""
    from megatron_tlt import launcher

    # vLLM warns about things that do not apply here (no tokenizer by design, the rotary embedding
    # having no weights to reload); keep the console for progress and results. (With a log_dir its
    # records go, at INFO, to the rank logs instead: rank_logs.py.)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    launcher.preload_in_ranks(*launcher.ENGINE_IMPORTS)
    return launcher.run_on_ranks(fn, nprocs, *args, isolated=True,
                                 log_dir=str(log_dir) if log_dir is not None else None)


def start_run(config_name: str | None, overrides: list[str], *, resume_dir: str | None = None):
    """Run to ``trainer.steps``; returns (run directory, summary records)."""
    from megatron_tlt.launcher import launched_world_size
    from megatron_tlt.rl.run import checkpoint_paths

    config = _load(config_name, overrides, resume_dir)
    if resume_dir is None:
        check_pretrained_config(config_name, config)
    _check_drafter_precision(config)  # before any directory is made or rank started
    _check_layout(config)
    launched = launched_world_size()
    under_torchrun = launched is not None
    if under_torchrun and launched != world_size(config):  # else each rank would start a world of its own
        raise ValueError(f"torchrun started {launched} ranks but the config needs tensor x pipeline x data "
                         f"parallel = {world_size(config)}; set parallel.data_parallel_size to match")
    # Under torchrun every rank runs this function: only global rank 0 writes the run directory; the
    # others wait for it at the barrier in commands/train.py.
    writer = not under_torchrun or launched_rank() == 0
    if resume_dir is not None:
        run_dir = Path(resume_dir)
        if checkpoint_paths.latest_checkpoint(run_dir) is None:
            raise run_files.RunDirError(f"{run_dir}: no complete checkpoint to resume from")
        config.trainer.run_dir = str(run_dir)
        config = run_values.decided(config, run_name=run_dir.name)
        if writer:
            atomic_files.write_text_atomic(run_dir / run_files.CONFIG_FILE, to_yaml(config))  # overrides (e.g. more steps) stick
    else:
        if under_torchrun and config.trainer.run_dir is None and world_size(config) > 1:
            raise run_files.RunDirError("under torchrun set trainer.run_dir (a directory every rank sees): "
                                        "each rank would otherwise make its own time-stamped directory")
        run_dir = Path(config.trainer.run_dir or run_files.default_run_dir())
        config.trainer.run_dir = str(run_dir)
        config = run_values.decided(config, run_name=run_dir.name)
        if writer:
            run_files.prepare_new_run_dir(run_dir, to_yaml(config))
    d = config.drafter
    if resume_dir is None and d.cold_start.enabled and d.depth > 0 and d.init_dir is None:
        # Recorded in the run's config.yaml: a resumed run knows where its drafter started. Under torchrun
        # every rank runs this: the drafter must be made beforehand (`tlt warmup-drafter`, or one `tlt train`).
        cold_start = obtain_cold_start(config_name, overrides, make=not under_torchrun,
                                       log_dir=run_dir / run_files.LOG_DIR / COLD_START_LOG_DIR)
        d.init_dir = str(cold_start.directory)
        if writer:
            atomic_files.write_text_atomic(run_dir / run_files.CONFIG_FILE, to_yaml(config))
            # the first step's record carries its wall time (RunReporter)
            atomic_files.write_text_atomic(run_dir / run_files.COLD_START_FILE, cold_start.to_json())
    if resume_dir is None and d.depth > 0 and d.init_dir is not None:
        _judge_speculation(config, run_dir, writer=writer)
    results = _run_on_engine_ranks(_train_on_rank, world_size(config), config, str(run_dir), resume_dir is not None,
                                   log_dir=run_dir / run_files.LOG_DIR)
    return run_dir, results.get(0)  # under torchrun each rank holds only its own result (records on rank 0)


def _judge_speculation(config, run_dir: Path, *, writer: bool) -> None:
    """Turn speculation off for a new run whose starting drafter cannot make it pay (``speculation_gate.py``):
    every rank judges alike; the writer says what it found, keeps the verdict beside the run's config.yaml, and
    records drafter.depth 0 there when speculation is off."""
    from megatron_tlt.commands import speculation_gate
    from megatron_tlt.rl.task_source import task_source

    verdict = speculation_gate.judge(config, task_source(config).architecture())
    if not verdict.serve:
        config.drafter.depth = 0
        # the arms were decided for the old depth: null lets a resume that sets drafter.depth decide them again
        config.speculation.depths = None
    if writer:
        print(verdict.describe(), flush=True)
        # the first step's record carries it (RunReporter)
        atomic_files.write_text_atomic(run_dir / run_files.SPECULATION_VERDICT_FILE, verdict.to_json())
        if not verdict.serve:
            atomic_files.write_text_atomic(run_dir / run_files.CONFIG_FILE, to_yaml(config))


def _warm_up_drafter_on_rank(config, policy_dir, out_dir: str):
    from megatron_tlt.commands.warmup_drafter import warm_up_drafter_on_rank  # imported in the rank

    return warm_up_drafter_on_rank(config, policy_dir, out_dir)


def warmup_log_dir(out_dir: str | Path) -> Path:
    """Where a warm-up outside a run keeps its ranks' logs: ``OUT.logs`` beside its output directory."""
    out = Path(out_dir)
    return out.with_name(out.name + ".logs")


def start_drafter_warmup(config_name: str | None, overrides: list[str], *, policy: str | None, out_dir: str,
                         log_dir: str | Path | None = None, announce: str | None = None) -> dict:
    """Warm a drafter up offline (``warmup_drafter.py``) as drafter.cold_start says; returns its before/after
    figures.

    Each rank's full output goes to ``log_dir/rank{N}.log`` (default ``warmup_log_dir(out_dir)``); the console
    keeps rank 0's progress bars, our warnings and every error (``rank_logs.py``). ``announce`` is printed once the
    input is checked, before the ranks start."""
    from megatron_tlt.formats.hf_io import check_output_dir
    from megatron_tlt.rl.run.checkpoint_paths import resolve_policy_dir

    config = load_config(config_name, overrides)
    check_pretrained_config(config_name, config)
    _check_drafter_precision(config)
    check_output_dir(out_dir)
    policy_dir = str(resolve_policy_dir(policy)) if policy is not None else None
    _check_layout(config)
    log_dir = Path(log_dir) if log_dir is not None else warmup_log_dir(out_dir)
    if announce is not None:
        print(announce, flush=True)
    return _run_on_engine_ranks(_warm_up_drafter_on_rank, world_size(config), config, policy_dir, out_dir,
                                log_dir=log_dir)[0]


def _bench_rollout_on_rank(config, policy_dir, drafter_dir: str, settings):
    from megatron_tlt import launcher
    from megatron_tlt.commands.bench_rollout import bench_on_rank  # imported in the rank: Megatron, vLLM

    if settings.as_a_rank:
        launcher.run_like_rank_zero_of(world_size(config))
    return bench_on_rank(config, policy_dir, drafter_dir, settings)


COLD_START_KEY_VERSION = 4
"""Part of every cold start's cache key: bump it when what a cold start makes changes without its settings changing
(then ``python -m checkpoints_tools.ship_tiny_default`` re-keys the shipped one). 3: drafter.cold_start a section,
hashed whole; 4: the policy answers without drafts and the held-out acceptance is teacher-forced."""
COLD_START_TRAINING_FIELDS = ("pack_tokens", "hidden_weight", "ce_weight", "tv_weight", "unroll_steps", "precision",
                              "init_dir")
"""The drafter's settings its cold-start training reads (its rate and budget are drafter.cold_start's own)."""
# How the RL run scores rewards (inline or on a Ray pool) does not reach the cold start, which scores nothing.
DATA_FIELDS_THE_COLD_START_IGNORES = ("reward_workers", "reward_timeout_s", "reward_failure_value", "ray_address")


def cold_start_dir(config) -> Path:
    """The cache entry of the config's cold-start drafter (it may not exist yet): keyed by drafter.cold_start whole
    and what the cold start reads of the policy, the prompts and the drafter's training, not by the RL-only
    drafter settings (depth, spot training, alarms), so the TLT-on and TLT-off arms of a benchmark share one."""
    from megatron_tlt.rl.run.artifact_cache import cache_key, cache_root, warmup_recipe

    d = config.drafter
    recipe = {k: v for k, v in dataclasses.asdict(d.cold_start).items() if k not in ("enabled", "max_response_tokens")}
    # A cap at or above the rollout's (null: the rollout's, as the run's config.yaml writes it) caps nothing: the
    # key hashes the rollout's cap under sampling, and leaving the field out keeps the keys made before it existed.
    cap = d.cold_start.response_cap(config.rollout.max_response_tokens)
    if cap < config.rollout.max_response_tokens:
        recipe["max_response_tokens"] = cap
    data = {k: v for k, v in dataclasses.asdict(config.data).items() if k not in DATA_FIELDS_THE_COLD_START_IGNORES}
    # A held-out file is what the cold start evaluates on (else the dataset's tail, which it then does not train
    # on); without one the field is left out, which keeps the keys made before it existed.
    if data["held_out_path"] is None:
        del data["held_out_path"]
    key = cache_key(version=COLD_START_KEY_VERSION, cold_start=recipe,
                    training={name: getattr(d, name) for name in COLD_START_TRAINING_FIELDS},
                    warmup=warmup_recipe(config), model=dataclasses.asdict(config.model), data=data,
                    parallel=dataclasses.asdict(config.parallel), seed=config.trainer.seed,
                    sampling=dict(temperature=config.rollout.temperature,
                                  max_response_tokens=config.rollout.max_response_tokens))
    return cache_root(config.warmup.cache_dir) / f"drafter-{key}"


COLD_START_LOG_DIR = "cold_start"
"""Under a run's ``logs/``: the ranks' logs of the cold start that run made."""


@dataclasses.dataclass(frozen=True)
class ColdStart:
    """A run's cold-start drafter: where it is, where it came from and what making it cost."""

    directory: Path
    source: str
    """"made" (by this call), "cache" (made before) or "package" (the tiny default's, installed from the package)."""
    seconds: float = 0.0
    """Wall time of the warm-up where this call made it (launching its ranks included); 0 otherwise."""
    figures: dict | None = None
    """The warm-up's before/after figures where this call made it (``warmup_drafter.py``)."""

    def to_json(self) -> str:
        return json.dumps({"source": self.source, "seconds": self.seconds, "drafter_dir": str(self.directory),
                           "figures": self.figures}, indent=1)


def cold_start_drafter(config_name: str | None, overrides: list[str], *, make: bool = True) -> Path:
    """The cold-start drafter of the config's initial policy (``tlt warmup-drafter``), installed from the
    package or made on first use (unless not ``make``) and cached: what ``drafter.cold_start.enabled`` and the
    benchmarks start from."""
    return obtain_cold_start(config_name, overrides, make=make).directory


def obtain_cold_start(config_name: str | None, overrides: list[str], *, make: bool = True,
                      log_dir: Path | None = None) -> ColdStart:
    """``cold_start_drafter``, saying where the drafter came from; a warm-up it makes says on the console what it
    does and why before it starts, and what it took after, and logs its ranks to ``log_dir`` (default
    ``warmup_log_dir`` of the cache entry)."""
    from megatron_tlt.commands import speculation_gate
    from megatron_tlt.rl.task_source import task_source
    from megatron_tlt.spec.ceiling import drafter_cost_share, speculation_ceiling

    config = load_config(config_name, overrides)
    directory = cold_start_dir(config)
    if (directory / "model.safetensors").is_file():
        return ColdStart(directory, "cache")
    if task_source(config).install_shipped(directory):
        return ColdStart(directory, "package")
    if not make:
        raise FileNotFoundError(f"drafter.cold_start.enabled: no cold-start drafter cached at {directory}; under torchrun "
                                "make it first (the same command without torchrun) or set drafter.init_dir")
    settings = config.drafter.cold_start
    log_dir = log_dir if log_dir is not None else warmup_log_dir(directory)
    announce = (f"cold start: no drafter cached for this policy and config, so one is distilled from the initial "
                f"policy before RL (its responses to up to {settings.prompts} prompts, then {settings.epochs} epochs "
                f"of training); made once, cached in {directory}; logs in {log_dir}")
    started = time.perf_counter()
    figures = start_drafter_warmup(config_name, overrides, policy=None, out_dir=str(directory), log_dir=log_dir,
                                   announce=announce)
    seconds = time.perf_counter() - started
    # as a run judges it: up to the first position no held-out chain reached (NaN)
    acceptance = speculation_gate.measured_prefix(figures["held_out_acceptance_by_position_after"])
    ceiling = None
    if acceptance:
        ceiling = speculation_ceiling(acceptance, drafter_cost_share(task_source(config).architecture()))
        figures = {**figures, "speculation_ceiling": ceiling.speedup, "speculation_ceiling_depth": ceiling.depth}
    print(f"cold start: done in {seconds / 60:.1f} min; held-out top-1 agreement with the policy "
          f"{figures['held_out_top1_agreement_before']:.3f} -> {figures['held_out_top1_agreement_after']:.3f}, "
          f"acceptance length at depth {figures['eval_depth']} (teacher-forced) "
          f"{figures['held_out_acceptance_length_before']:.2f} -> {figures['held_out_acceptance_length_after']:.2f}"
          + (f"; {ceiling.describe()}" if ceiling else ""), flush=True)
    return ColdStart(directory, "made", seconds, figures)


def start_rollout_bench(config_name: str | None, overrides: list[str], *, policy: str | None, drafter: str | None,
                        settings) -> dict:
    """``tlt bench rollout``: no speculation vs fixed depths vs BEG-MAB on one rollout, in one rank process."""
    from megatron_tlt.drafter.checkpoint_paths import resolve_drafter_dir
    from megatron_tlt.rl.run.checkpoint_paths import resolve_policy_dir

    config = load_config(config_name, overrides)
    if settings.prompts < 1 or settings.rounds < 1 or not settings.depths or min(settings.depths) < 0 \
            or max(settings.depths) < 1 or len(set(settings.depths)) != len(settings.depths):
        raise ValueError("--prompts and --rounds must be >= 1 and --depths a list of distinct depths >= 0, one of "
                         "them >= 1")
    if config.data.path is None and settings.rotate_prompts:
        # Enough held-out problems that no rollout of the bench repeats another's prompts.
        config.data.held_out_prompts = max(config.data.held_out_prompts, settings.prompts * settings.rollouts)
    _check_layout(config)
    policy_dir = str(resolve_policy_dir(policy)) if policy is not None else None
    drafter_dir = resolve_drafter_dir(drafter) if drafter is not None else cold_start_drafter(config_name, overrides)
    return _run_on_engine_ranks(_bench_rollout_on_rank, 1, config, policy_dir, str(drafter_dir), settings)[0]
