"""Weight sync: Megatron's TP/PP shards -> HF-layout tensors -> every rank's rollout engine.

All ranks call ``sync_policy_to_engine`` together. Tensors travel in size-bounded buckets, in
layer order, each bucket owned by one pipeline stage:
  1. the owning stage's TP ranks all-gather their shards of the bucket (one flat collective) and
     merge them into Megatron-full tensors (``weights.merge_tp_shards`` un-splits rows, columns
     and the stacked gate/up);
  2. with PP > 1 the owning stage broadcasts the bucket to the other stages;
  3. each full tensor is un-fused into HF tensors (q/k/v, gate/up, vocabulary padding dropped)
     and handed to the engine as the engine's loader consumes them.
Only one bucket of full tensors exists at a time: no second copy of the model is built.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_tlt.device import module_device
from megatron_tlt.formats import weights
from megatron_tlt.formats.architecture import PolicyArchitecture
from megatron_tlt.model import mcore
from megatron_tlt.spec.metrics import SpecDecodeStats

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class SyncStats:
    """What one sync moved into this rank's engine."""

    num_bytes: int
    seconds: float
    num_buckets: int
    kept: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Copies of the tensors the caller asked to keep, by HF name."""
    probe: SpecDecodeStats | None = None
    """The acceptance probe that followed the sync and drafter push (``RankSession.sync``), if one ran."""
    alarm: bool = False
    """Whether that probe found acceptance collapsed."""

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else math.inf


@dataclasses.dataclass(frozen=True)
class _Bucket:
    stage: int
    names: tuple[str, ...]


def _plan_buckets(arch: PolicyArchitecture, pp_size: int, padded_vocab_size: int, element_size: int,
                  bucket_bytes: int) -> list[_Bucket]:
    buckets: list[_Bucket] = []
    names: list[str] = []
    stage, size = None, 0
    for name in weights.megatron_names(arch):
        owner = weights.owning_stage(arch, name, pp_size)
        nbytes = math.prod(weights.megatron_full_shape(arch, name, padded_vocab_size)) * element_size
        if names and (owner != stage or size + nbytes > bucket_bytes):
            buckets.append(_Bucket(stage, tuple(names)))
            names, size = [], 0
        names.append(name)
        stage, size = owner, size + nbytes
    if names:
        buckets.append(_Bucket(stage, tuple(names)))
    return buckets


def _gather_tensor_parallel(names: tuple[str, ...], shards: list[torch.Tensor]) -> list[torch.Tensor]:
    group = mcore.tensor_parallel_group()
    tp_size = dist.get_world_size(group)
    if tp_size == 1:
        return shards
    flat = torch.cat([s.reshape(-1) for s in shards])
    gathered = [torch.empty_like(flat) for _ in range(tp_size)]
    dist.all_gather(gathered, flat, group=group)
    sizes = [s.numel() for s in shards]
    per_rank = [torch.split(g, sizes) for g in gathered]
    return [
        weights.merge_tp_shards(name, [per_rank[r][i].view_as(shards[i]) for r in range(tp_size)])
        for i, name in enumerate(names)
    ]


def _broadcast_pipeline(bucket: _Bucket, fulls: list[torch.Tensor] | None, shapes: list[tuple[int, ...]],
                        dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    group = mcore.pipeline_parallel_group()
    if dist.get_world_size(group) == 1:
        return fulls
    sizes = [math.prod(s) for s in shapes]
    flat = torch.cat([f.reshape(-1) for f in fulls]) if fulls is not None else torch.empty(sum(sizes), dtype=dtype, device=device)
    dist.broadcast(flat, src=dist.get_global_rank(group, bucket.stage), group=group)
    return [piece.view(shape) for piece, shape in zip(torch.split(flat, sizes), shapes)]


def _element_size(model: torch.nn.Module) -> int:
    return torch.empty((), dtype=mcore.unwrap(model).config.params_dtype).element_size()


def _iter_buckets(model: torch.nn.Module, arch: PolicyArchitecture, padded_vocab_size: int,
                  buckets: list[_Bucket]) -> Iterator[tuple[str, torch.Tensor]]:
    stage = mcore.stage_info()
    layers_per_stage = arch.num_layers // stage.pp_size
    local_state = mcore.unwrap(model).state_dict()
    dtype = mcore.unwrap(model).config.params_dtype
    device = module_device(model)
    for bucket in buckets:
        fulls = None
        if stage.pp_rank == bucket.stage:
            shards = [local_state[weights.local_name(n, bucket.stage, layers_per_stage)].detach() for n in bucket.names]
            fulls = _gather_tensor_parallel(bucket.names, shards)
        shapes = [weights.megatron_full_shape(arch, n, padded_vocab_size) for n in bucket.names]
        fulls = _broadcast_pipeline(bucket, fulls, shapes, dtype, device)
        for name, full in zip(bucket.names, fulls):
            yield from weights.to_hf(arch, name, full)


def iter_hf_tensors(model: torch.nn.Module, arch: PolicyArchitecture, *, padded_vocab_size: int,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor of the whole policy, on every rank (collective; consume it fully).

    Tensors may be views of the model's parameters: copy them before changing the model.
    """
    buckets = _plan_buckets(arch, mcore.stage_info().pp_size, padded_vocab_size, _element_size(model), bucket_bytes)
    return _iter_buckets(model, arch, padded_vocab_size, buckets)


def sync_policy_to_engine(model: torch.nn.Module, arch: PolicyArchitecture, engine, *, padded_vocab_size: int,
                          bucket_bytes: int = DEFAULT_BUCKET_BYTES, keep: frozenset[str] = frozenset()) -> SyncStats:
    """Stream the current policy into this rank's engine (collective over all ranks).

    Copies of the HF tensors named in ``keep`` (e.g. the embedding the drafter needs) are returned in
    ``SyncStats.kept``. The acceptance probe comes after the drafter push (``RankSession.sync``).
    """
    buckets = _plan_buckets(arch, mcore.stage_info().pp_size, padded_vocab_size, _element_size(model), bucket_bytes)
    moved = {"bytes": 0}
    kept: dict[str, torch.Tensor] = {}

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in _iter_buckets(model, arch, padded_vocab_size, buckets):
            moved["bytes"] += tensor.numel() * tensor.element_size()
            if name in keep:
                kept[name] = tensor.detach().clone()
            yield name, tensor

    started = time.perf_counter()
    engine.load_weights(counted())
    if torch.cuda.is_available():  # the engine's copies into its weights are asynchronous: time them landed
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return SyncStats(num_bytes=moved["bytes"], seconds=seconds, num_buckets=len(buckets), kept=kept)
