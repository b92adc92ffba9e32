"""Which device this rank computes on, and moving a batch there: decided here and nowhere else.

Batch builders write their rows into host tensors (cheap Python-side writes) and hand each finished
tensor to ``to_device`` once, rather than scattering many small writes into device memory. Step
functions move the batches they are given to ``module_device(model)``, so a batch built anywhere
meets the model on its device. Small counters that go through ``torch.distributed`` stay on the CPU
on purpose: the default group is "cpu:gloo,cuda:nccl" on GPU, so CPU tensors take gloo.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import torch

T = TypeVar("T")


def compute_device() -> torch.device:
    """This rank's device: the current CUDA device (``ParallelLayout`` sets it from LOCAL_RANK), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def module_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s parameters live; DDP/Float16Module wrappers hold their module's parameters."""
    return next(model.parameters()).device


def to_device(batch: T, device: torch.device) -> T:
    """``batch`` (a tensor, or a frozen dataclass whose fields are tensors or None) with its tensors on
    ``device``; a tensor already there is not copied."""
    if isinstance(batch, torch.Tensor):
        # Asynchronous only towards an accelerator: a non-blocking copy to the host may be read before it lands.
        return batch.to(device, non_blocking=device.type != "cpu")
    return dataclasses.replace(batch, **{
        field.name: to_device(value, device) for field in dataclasses.fields(batch)
        if isinstance(value := getattr(batch, field.name), torch.Tensor)})
