"""The values a config leaves to the run (``null`` for "decided when it starts"), decided before the run's
``config.yaml`` is written, so that the file says what ran.

Those that need only the config and the device are decided here; the engine's context length and, on CPU, its
KV-cache size need the task and the host's memory, so the rank session decides them and rank 0 writes them back
(``rl/run/run_state.record_engine``). A null that means "none" or "off" (``model.hf_dir``, ``algorithm.tis_cap``,
``speculation.max_speculative_batch``) stays null.
"""

from __future__ import annotations

import dataclasses

from megatron_tlt.config import TLTConfig
from megatron_tlt.drafter.device_defaults import quality_every, spot_duty_cycle
from megatron_tlt.layout_rules import resolve_engine_tp
from megatron_tlt.rl.run.artifact_cache import cache_root


NULL_MEANS_NONE = frozenset({"model.hf_dir", "data.path", "data.held_out_path", "data.ray_address", "algorithm.tis_cap",
                             "drafter.init_dir", "speculation.max_speculative_batch"})
"""The keys whose null is a value of its own (no model directory, no data file, no held-out file, no Ray cluster, no
TIS, a random drafter start, no batch limit on speculation): every other null of a run's config.yaml is decided when
it starts."""


def decided(config: TLTConfig, *, run_name: str) -> TLTConfig:
    """``config`` with the values its nulls leave to the run filled in as this device decides them."""
    d, s, t = config.drafter, config.speculation, config.trainer
    engine = config.rollout.engine
    return dataclasses.replace(
        config,
        warmup=dataclasses.replace(config.warmup, cache_dir=str(cache_root(config.warmup.cache_dir))),
        rollout=dataclasses.replace(config.rollout, engine=dataclasses.replace(
            engine, tensor_parallel_size=resolve_engine_tp(engine.tensor_parallel_size,
                                                           config.parallel.tensor_parallel_size))),
        drafter=dataclasses.replace(d, spot_duty_cycle=spot_duty_cycle(d.spot_duty_cycle),
                                    quality_every=quality_every(d.quality_every),
                                    cold_start=dataclasses.replace(d.cold_start, max_response_tokens=(
                                        d.cold_start.response_cap(config.rollout.max_response_tokens)))),
        speculation=dataclasses.replace(s, depths=list(s.arms(d.depth))),
        trainer=dataclasses.replace(t, wandb_name=t.wandb_name or run_name))
