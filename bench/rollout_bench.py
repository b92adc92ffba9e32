"""``tlt bench rollout`` on its rank: the long-tail rollout of the tiny default, without and with speculation, in one
process (``megatron_tlt/commands/bench_rollout.py`` is the command; ``bench/rollout_figures.py`` its figures).

Two engines hold the same policy side by side: one without speculation (the baseline), one with an EAGLE
drafter and the adaptive scheduler, run either at a pinned depth K (fixed-K speculation), at the depths of
vLLM's per-batch-size table (vLLM's own static rival, written per bucket from the untimed round's sweep), or with
a depth policy (BEG-MAB, goodput) choosing each step's depth. The engine has no methods for a bench's depths: this
module sets them on its scheduler (``_set_depths``), where the policy is swapped and a depth pinned. The process
runs on the cores and threads one rank of the config's run gets, as the RL loop's engines do. Every round runs every
mode once on the same prompts, so the modes share the machine's slow and quiet spells. Greedy (the default), their
outputs must be identical token for token (speculation is lossless). ``--sampled`` samples as the RL rollout does
(``rollout.samples_per_prompt`` responses per prompt at ``rollout.temperature``): outputs then differ between modes
draw by draw, and losslessness at temperature 1 is the chi-square test's (tests/dist/lossless_sampling.py). Each
round takes the next prompts of the held-out pool, as each RL step takes new ones: a rollout's time hangs on its
few longest sequences, so one fixed prompt set would measure one tail. The bandit keeps what it learned from round
to round, as it does from RL step to RL step; a first, untimed round of every mode warms the engines, then BEG-MAB
learns over a few more untimed rollouts (in an RL run it learns over hundreds), and its cold first rollout is
reported beside the timed ones.

vLLM's table runs as a depth policy that reads the table (``TableDepths``), no longer as a pin of the scheduler:
a change of depth between two steps is held for a second step, as for the adaptive policies (the scheduler's
clean-credit rule), where a pin switched at once. Within a rollout the batch rarely skips a table range in one
step, so the depths it runs are the table's.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # bench/ holds scripts, not a package: siblings by name
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import rollout_figures as rf  # noqa: E402
from depth_table import DepthSweepRun, table_from_sweep  # noqa: E402

from megatron_tlt.config import TLTConfig  # noqa: E402

logger = logging.getLogger("megatron_tlt.commands.bench_rollout")  # the command's: its ranks log as the package's


def run_on_rank(config: TLTConfig, policy_dir: str | None, drafter_dir: str, settings) -> dict:
    """One process: build both engines, run ``settings.rounds`` x every mode, return the figures
    (``settings``: the command's ``RolloutBenchSettings``)."""
    from megatron_tlt.drafter import store
    from megatron_tlt.drafter.tlt_drafter import FrozenDrafter
    from megatron_tlt.parallel import ParallelLayout
    from megatron_tlt.rl.rank_session import RankSession
    from megatron_tlt.spec.adaptive_scheduler import depth_policy_for
    from megatron_tlt.spec.engine import SpeculativeSettings

    # K=0 among --depths is the speculating engine with drafting off: what it costs beside the plain engine
    bandit = dataclasses.replace(config.speculation, adaptive=True, depths=sorted({0, *settings.depths}),
                                 policy="bandit")
    speculation = SpeculativeSettings(num_speculative_tokens=max(settings.depths), adaptive=bandit,
                                      seed=config.trainer.seed, draft_sampling=config.speculation.draft_sampling)
    with ParallelLayout(seed=config.trainer.seed), tempfile.TemporaryDirectory(prefix="tlt-bench-rollout-") as workdir:
        session = RankSession(config, policy_dir=Path(policy_dir) if policy_dir is not None else None,
                              show_progress=True)
        task = session.task
        drafter = FrozenDrafter(store.read_drafter_tensors(drafter_dir, task.arch))
        plain = session.open_engine(Path(workdir) / "plain")
        speculative = session.open_engine(Path(workdir) / "spec", speculative=speculation, drafter=drafter)
        try:
            session.sync(plain)
            session.sync(speculative, drafter)
            pool = [e.prompt_ids for e in task.held_out or task.dataset.examples]
            rollouts = prompt_sets(pool, settings.prompts, settings.rotate_prompts)
            greedy = session.sampling(n=1, temperature=0.0, seed=None)
            rollout = greedy
            if settings.sampled:  # the engine's seeded RNG draws (per-request seeds are off while speculating)
                rollout = session.sampling(n=config.rollout.samples_per_prompt, temperature=config.rollout.temperature,
                                           seed=None)
            # One engine, two depth policies, each swapped in for its own rollouts and keeping what it learned.
            policies = {rf.BANDIT: speculative.adaptive_scheduler().bandit,
                        rf.GOODPUT: depth_policy_for(dataclasses.replace(bandit, policy=rf.GOODPUT),
                                                     max(settings.depths), config.trainer.seed)}
            adaptive = list(policies)
            modes = [rf.NO_SPECULATION, *(f"K={k}" for k in settings.depths), rf.VLLM_TABLE, *adaptive]
            runs: dict[str, list[rf.ModeRun]] = {m: [] for m in modes}
            summaries = {}
            table = settings.vllm_table
            for round_index in range(-1, settings.rounds):  # round -1: untimed warm-up
                if round_index == 0:
                    cold = {m: runs[m].pop() for m in adaptive}
                    runs = {m: [] for m in modes}
                    for _ in range(settings.bandit_warmup_rollouts):
                        prompts = next(rollouts)
                        for mode in adaptive:
                            _set_depths(speculative, policy=policies[mode])
                            speculative.generate(prompts, rollout)
                prompts = next(rollouts)
                for mode in modes:
                    if mode == rf.NO_SPECULATION:
                        runs[mode].append(_run(plain, prompts, rollout))
                        continue
                    if mode == rf.VLLM_TABLE:
                        if table is None:  # from the untimed round only: the timed rounds stay unseen
                            table = sweep_table(runs, bandit.bucket_bounds, session.engine_config.max_num_seqs)
                        _set_depths(speculative, policy=TableDepths(table, speculative.adaptive_scheduler()))
                    elif mode in adaptive:
                        _set_depths(speculative, policy=policies[mode])
                    else:
                        _set_depths(speculative, depth=int(mode[2:]))
                    runs[mode].append(_run(speculative, prompts, rollout))
                    if mode in adaptive:
                        summaries[mode] = speculative.bandit_summary()
                logger.info("round %d of %d done", round_index + 1, settings.rounds)
            figures = rf.mode_figures(runs, summaries[rf.BANDIT], settings.prompts, sampled=settings.sampled)
            figures["goodput"] = summaries[rf.GOODPUT]
            figures["vllm_table"] = [list(entry) for entry in table]
            figures["seconds_by_bucket"], figures["step_ms_by_bucket"] = rf.by_bucket(runs, bandit)
            base = statistics.fmean(r.seconds for r in runs[rf.NO_SPECULATION])
            figures["bandit_cold_first_rollout_speedup"] = base / cold[rf.BANDIT].seconds
            figures["goodput_cold_first_rollout_speedup"] = base / cold[rf.GOODPUT].seconds
            return figures
        finally:
            session.close()


def _set_depths(engine, *, policy=None, depth: int | None = None) -> None:
    """The depths of the speculating engine's next rollouts: ``policy`` in charge of its scheduler (None: the one in
    charge stays), every step at ``depth`` (None: the policy chooses). A bench's need, not the engine's: it reaches
    the engine's adaptive scheduler (``spec/adaptive_scheduler.py``), where the policy is ``bandit``."""
    scheduler = engine.adaptive_scheduler()
    if policy is not None:
        scheduler.bandit = policy
    scheduler.pin_depth(depth)


class TableDepths:
    """vLLM's static per-batch-size speculation as a depth policy: each step at the depth a
    ``num_speculative_tokens_per_batch_size`` table (first batch, last batch, depth) gives its batch size, expanded
    by vLLM's own function as its stock scheduler expands the configured table, and never deeper than the engine's
    own table allows (above ``speculation.max_speculative_batch`` no speculative shapes exist). It learns nothing."""

    kind = "vllm_table"

    def __init__(self, table: list[tuple[int, int, int]], scheduler) -> None:
        from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

        if not all(0 <= depth <= scheduler.num_spec_tokens for _, _, depth in table):
            raise ValueError(f"table {table}: depths must lie in 0..{scheduler.num_spec_tokens} (the engine's "
                             "maximum)")
        lookup = build_dynamic_sd_schedule_lookup(
            [list(entry) for entry in table], vllm_max_batch_size=scheduler.scheduler_config.max_num_seqs,
            vllm_num_speculative_tokens=max(scheduler.num_spec_tokens, 1))
        self._lookup = [min(depth, allowed) for depth, allowed in zip(lookup, scheduler.dynamic_sd_lookup)]

    def choose(self, batch_size: int, live=()) -> int:
        return self._lookup[min(batch_size, len(self._lookup) - 1)]

    def observe_step(self, batch_size: int, depth: int, tokens: int, seconds: float) -> None:
        """A table learns nothing."""

    def observe_drafts(self, request_id: str, drafted: int, accepted: int) -> None:
        """A table learns nothing."""

    def forget_requests_except(self, live) -> None:
        """A table keeps no requests."""

    def rate(self, batch_size: int, depth: int) -> None:
        """A table knows no rates (the rollout then has no speedup estimate)."""

    def summary(self) -> dict:
        return {}


def _run(engine, prompts, sampling) -> rf.ModeRun:
    result = engine.generate(prompts, sampling)
    return rf.ModeRun(result.seconds, result.num_generated_tokens,
                      rf.tail_seconds(result.step_batch_sizes, result.step_seconds),
                      result.spec.mean_acceptance_length, result.token_ids, result.step_batch_sizes, result.step_seconds)


def sweep_table(runs: dict[str, list[rf.ModeRun]], bucket_bounds, max_batch: int):
    """vLLM's static table from the last run of each fixed depth. Depth 0 is the speculating engine's own K=0 run
    where --depths has one (the table runs on that engine), else the plain engine's."""

    def sweep_run(mode: str) -> DepthSweepRun:
        last = runs[mode][-1]
        return DepthSweepRun(last.step_batch_sizes, last.step_seconds, last.acceptance_length)

    sweep = {0: sweep_run(rf.NO_SPECULATION)}
    sweep.update({int(mode[2:]): sweep_run(mode) for mode in runs if mode.startswith("K=")})
    return table_from_sweep(sweep, bucket_bounds, max_batch)


def prompt_sets(pool: list, size: int, rotate: bool) -> Iterator[list]:
    """Endless rollouts of ``size`` prompts: consecutive slices of the pool (wrapping round), or its first ``size``."""
    if not pool:
        raise ValueError("tlt bench rollout: the task has no prompts")
    start = 0
    while True:
        yield [pool[(start + i) % len(pool)] for i in range(size)]
        if rotate:
            start = (start + size) % len(pool)
