"""Peak tensor memory of a block of code, measured on any device (the CPU has no allocator statistics).

``PeakMemoryMeter`` is a ``TorchDispatchMode``: every tensor an operator returns inside the block has its
storage recorded (once, however many views share it) and a weak reference that subtracts its bytes when the
storage is freed; an output that aliases an input (a view, an in-place op) allocates nothing and is not
counted. ``peak_bytes`` is the most that storages created inside the block held at once: on top of
what existed before (the model's weights, gradient buffers, optimizer state), which is what the block adds,
for a training step its activations and temporaries. The same idea as torch's
``torch.distributed._tools.mem_tracker.MemTracker``, whose module hooks do not work through Megatron's DDP
wrapper (it has a ``buffers`` attribute that shadows ``Module.buffers``), so the module-free core is here.

On CUDA, ``torch.cuda.max_memory_allocated`` measures the same thing from the allocator itself, which
``tests/gpu`` uses; the two agree up to the allocator's rounding to 512-byte blocks.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


class PeakMemoryMeter(TorchDispatchMode):
    """``with PeakMemoryMeter() as meter: ...`` then ``meter.peak_bytes`` (bytes created inside, at most live at once)."""

    def __init__(self):
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def _freed(self, nbytes: int, _ref) -> None:
        self.live_bytes -= nbytes

    def _record(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen[storage] = weakref.ref(storage, lambda ref, n=nbytes: self._freed(n, ref))
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # An output that shares an input's storage (a view, an in-place or out= op) allocated nothing.
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for leaf in tree_leaves(out):
            if (isinstance(leaf, torch.Tensor) and leaf.device.type != "meta"
                    and leaf.untyped_storage().data_ptr() not in inputs):
                self._record(leaf)
        return out
