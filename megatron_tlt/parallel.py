"""ParallelLayout: the one object that owns process groups and Megatron's parallel state.

It initialises ``torch.distributed`` (NCCL on GPU, gloo on CPU) from torchrun's environment, or as
a world of one when a command runs without torchrun, switches on the CPU compatibility layer when
CUDA is absent, and creates Megatron's tensor/pipeline/data-parallel groups. No other module reads
``RANK``/``WORLD_SIZE`` or initialises Megatron state.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

from megatron_tlt import cpu_compat
from megatron_tlt.device import compute_device


class LayoutError(ValueError):
    """A parallel layout that does not fit the world it is launched into."""


def bind_local_gpu() -> None:
    """This rank takes the GPU of its local index. NCCL needs one GPU a rank, so more ranks on a node than it has
    GPUs are refused here, in words, rather than by CUDA's "invalid device ordinal" or NCCL's duplicate-GPU check."""
    local_rank, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local_rank >= gpus:
        raise LayoutError(f"local rank {local_rank} has no GPU of its own: this node has {gpus}; launch at most "
                          f"{gpus} rank(s) a node (parallel.data_parallel_size x tensor x pipeline parallel sizes)")
    torch.cuda.set_device(local_rank)


@dataclasses.dataclass(kw_only=True)
class ParallelLayout:
    """Tensor x pipeline x data parallel sizes of one run; world = tp * pp * dp."""

    tensor_parallel_size: int = 1
    """Ranks that split each weight matrix (Megatron TP)."""
    pipeline_parallel_size: int = 1
    """Ranks that split the layer stack into stages (Megatron PP)."""
    seed: int = 1234
    """Base seed; Megatron derives the per-TP-rank streams from it."""

    rank: int = dataclasses.field(init=False, default=0)
    world_size: int = dataclasses.field(init=False, default=1)
    initialized_here: bool = dataclasses.field(init=False, default=False)
    data_parallel_rank: int = dataclasses.field(init=False, default=0)
    """This rank's replica of the policy."""
    model_parallel_group: object = dataclasses.field(init=False, default=None)
    """The tp x pp ranks that together hold this rank's replica (Megatron's group)."""
    model_parallel_rank: int = dataclasses.field(init=False, default=0)
    """This rank's place in ``model_parallel_group``."""
    stage: object = dataclasses.field(init=False, default=None)
    """Where this rank's piece of the policy sits (``mcore.StageInfo``: TP and PP rank and size)."""

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_parallel_size * self.pipeline_parallel_size)

    @property
    def device(self) -> torch.device:
        return compute_device()

    def initialize(self) -> "ParallelLayout":
        """Join (or create) the default process group and build Megatron's groups."""
        from megatron_tlt.model import mcore

        cpu_compat.enable()
        if not dist.is_initialized():
            if torch.cuda.is_available():
                bind_local_gpu()
            # On GPU the default group also gets gloo for CPU tensors: the RL loop's small counters,
            # object gathers and the spot trainer's barrier stay off the GPU; model tensors use NCCL.
            backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
            timeout = datetime.timedelta(minutes=10)
            if "RANK" in os.environ:  # launched by torchrun / elastic launch
                dist.init_process_group(backend=backend, timeout=timeout)
            else:  # a plain command: a world of one, on a store bound to a port the OS picks
                store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
                dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)
            self.initialized_here = True
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        model_parallel = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.world_size % model_parallel:
            if self.initialized_here:  # leave no half-built process group behind
                dist.destroy_process_group()
                self.initialized_here = False
            raise LayoutError(
                f"world size {self.world_size} is not a multiple of tensor_parallel_size "
                f"{self.tensor_parallel_size} x pipeline_parallel_size {self.pipeline_parallel_size}"
            )
        mcore.initialize_model_parallel(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            seed=self.seed,
        )
        self.data_parallel_rank = mcore.data_parallel_rank()
        self.model_parallel_group = mcore.model_parallel_group()
        self.model_parallel_rank = dist.get_rank(self.model_parallel_group)
        self.stage = mcore.stage_info()
        return self

    def close(self) -> None:
        """Tear down Megatron's groups and, if we created it, the default group."""
        from megatron_tlt.model import mcore

        mcore.destroy_model_parallel()
        if self.initialized_here and dist.is_initialized():
            dist.destroy_process_group()
            self.initialized_here = False

    def __enter__(self) -> "ParallelLayout":
        return self.initialize()

    def __exit__(self, *exc) -> None:
        self.close()
