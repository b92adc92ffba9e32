"""``tlt bench rollout``: the long-tail rollout of the tiny default, without speculation, at fixed depths, at vLLM's
per-batch-size table and with the depth policies (BEG-MAB, goodput), in one rank process.

The command's settings live here; the bench itself is in the repository's ``bench/`` folder, with the other
benchmarks: ``bench/rollout_bench.py`` runs the engines and rounds on the rank, ``bench/rollout_figures.py``
computes and prints the figures, ``bench/depth_table.py`` writes and reads vLLM's table. The command therefore runs
from a checkout of the repository (``pip install -e .``), as the launch configs it reads do.

Reported per mode: wall time, generated tokens/s, mean acceptance length, speedup over no speculation, the speedup
on the long-tail phase (the engine steps after half the sequences have finished), and, sampled, the speedups on
equal work.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path

from megatron_tlt.config import TLTConfig

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def bench_module(name: str):
    """``bench/<name>.py`` imported (bench/ holds scripts, not a package: its modules import each other by name)."""
    if not (BENCH_DIR / f"{name}.py").is_file():
        raise FileNotFoundError(f"tlt bench rollout: {BENCH_DIR / name}.py not found; the bench runs from a checkout "
                                "of the repository (pip install -e .)")
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    return importlib.import_module(name)


@dataclasses.dataclass(kw_only=True)
class RolloutBenchSettings:
    prompts: int = 64
    """Prompts in the rollout: greedy, one response each (one rank's share of a tiny-default step is 64
    sequences), or, ``sampled``, ``rollout.samples_per_prompt`` each (the default's share is 8 prompts)."""
    sampled: bool = False
    """Sample as the RL rollout does (its samples per prompt, at its temperature) instead of greedy."""
    rotate_prompts: bool = True
    """Each rollout takes the next ``prompts`` of the held-out pool (cycling); False: every rollout runs the
    pool's first ``prompts``."""
    depths: tuple[int, ...] = (1, 2, 3, 4)
    """Fixed depths to compare; the bandit chooses among 0 and these. 0 here runs the speculating engine with
    drafting off, beside the plain engine of "no speculation"."""
    rounds: int = 3
    bandit_warmup_rollouts: int = 10
    """Untimed BEG-MAB rollouts before the timed rounds: in an RL run the bandit learns over hundreds of
    rollouts (its state is kept from step to step); one rollout here has only ~60 engine steps."""
    vllm_table: list[tuple[int, int, int]] | None = None
    """The static table to race (first batch, last batch, depth); None: written per bucket from the fixed
    depths' untimed first round (``bench/depth_table.py``), as a user would from a sweep."""
    as_a_rank: bool = True
    """Run with the cores and threads one rank of the config's run gets (on 2 cores with 2 ranks: one core and
    one thread, as the launcher pins them), not every core: what an engine does in the RL loop."""

    @property
    def rollouts(self) -> int:
        """Distinct prompt sets the bench runs: the warm-up round, the bandit's learning rollouts, the rounds."""
        return 1 + self.bandit_warmup_rollouts + self.rounds


def bench_on_rank(config: TLTConfig, policy_dir: str | None, drafter_dir: str, settings: RolloutBenchSettings) -> dict:
    """One process: build both engines, run ``rounds`` x every mode, return the figures."""
    return bench_module("rollout_bench").run_on_rank(config, policy_dir, drafter_dir, settings)


def parse_vllm_table(text: str) -> list[tuple[int, int, int]]:
    """``--vllm-table``'s ``first-last:depth`` entries (``bench/depth_table.py``)."""
    return bench_module("depth_table").parse_table(text)


def format_figures(figures: dict) -> str:
    return bench_module("rollout_figures").format_figures(figures)


def write_figures(figures: dict, path: str | Path) -> None:
    bench_module("rollout_figures").write_figures(figures, path)
