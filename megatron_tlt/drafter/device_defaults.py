"""The drafter settings whose default depends on the device: decided when a run starts (``commands/run_values.py``)
and written into its ``config.yaml``."""

from __future__ import annotations

import torch

CPU_SPOT_DUTY_CYCLE = 0.25
"""bench/spot_overhead.py on 2 CPU cores: +7.8% critical path training all idle time, none measurable at 0.25."""
CPU_QUALITY_EVERY = 4
"""bench/tlt_end_to_end.py on 2 CPU cores (2026-11-29): the held-out measure took 0.3-1.5 s of 9-24 s steps."""


def quality_every(configured: int | None) -> int:
    """drafter.quality_every, or its default: every step on GPU, where one forward over the slice is a sliver of a
    step; every CPU_QUALITY_EVERY-th on CPU, where the forward and the measure cost 5-8% of a tiny-default step."""
    if configured is not None:
        return configured
    return 1 if torch.cuda.is_available() else CPU_QUALITY_EVERY


def spot_duty_cycle(configured: float | None) -> float:
    """drafter.spot_duty_cycle, or its default: a GPU rank trains on its own device, CPU ranks share a memory bus."""
    if configured is not None:
        return configured
    return 1.0 if torch.cuda.is_available() else CPU_SPOT_DUTY_CYCLE
