"""Does the GPU kit import on the device? Emulated on a CPU machine, before any device time is spent.

    python3 launch/gpu_kit_check.py imports SITE     # the kit installed in SITE (pip install --target SITE)
    python3 launch/gpu_kit_check.py requires WHEELS  # what the kit's wheels declare that neither the device
                                                     # nor the kit holds: each left out on purpose, or a gap
    python3 launch/gpu_kit_check.py loadable WHEELS  # the kit's wheels this interpreter loads (paths) ...
    python3 launch/gpu_kit_check.py foreign WHEELS   # ... and the others (name==version): built for Python 3.12,
                                                     # their twins for this Python stand in for them in SITE
    python3 launch/gpu_kit_check.py standins WHEELS  # device packages at the device's version, for SITE too

``imports`` runs a fresh interpreter without site-packages (``python3 -S``) whose path holds SITE, this
repository and a folder of links to the host's installed distributions that the device image also has
(launch/gpu_device_packages.txt): a package the device lacks is absent there as it is on the device, for
``import`` and ``importlib.metadata`` alike. It then imports what an in-process engine with EAGLE, in fp32 or
bf16, imports (ENGINE_MODULES) with vLLM's CUDA platform chosen as on an H200 (compute capability 9.0; its
compiled kernels stubbed, NVML absent), then our own GPU-side modules; it fails if any of them fails.
What this cannot see: the host's versions stand in for the device's where no wheel of the device's version
loads here (torch 2.13+cpu here against 2.11+cu130 there, triton, numpy), so a version-only break passes here;
compiled CUDA code is never loaded (vLLM's kernels, sleep mode's allocator, which needs libcudart loaded);
imports made only inside functions that an engine calls at run time.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as metadata
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEVICE_PACKAGES = Path(__file__).with_name("gpu_device_packages.txt")

# What an in-process engine with EAGLE loads at import, as roots (each pulls in its own imports): the
# engine's entry points, the CUDA platform and worker, the fp32-capable attention backends, the EAGLE
# proposer and drafter models, the sampler, structured output (imported by the engine core), the weight
# transfer and reload our sync uses.
ENGINE_MODULES = (
    "vllm", "vllm.engine.arg_utils", "vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.engine.llm_engine",
    "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.attention.backends.triton_attn", "vllm.v1.attention.backends.flex_attention",
    "vllm.v1.attention.backends.fa_utils", "vllm.v1.spec_decode.eagle", "vllm.model_executor.models.llama",
    "vllm.model_executor.models.llama_eagle", "vllm.model_executor.models.llama_eagle3",
    "vllm.model_executor.models.qwen2", "vllm.v1.sample.sampler", "vllm.v1.sample.rejection_sampler",
    "vllm.v1.structured_output", "vllm.v1.core.sched.scheduler",
    "vllm.distributed.weight_transfer", "vllm.model_executor.model_loader.reload",
)
# Ours, on the GPU: the engine adapter, the trainer, the drafter's FP8 backend, the CLI.
PROJECT_MODULES = (
    "megatron.core", "omegaconf", "torchao.float8", "megatron_tlt.spec.engine", "megatron_tlt.spec.adaptive_scheduler",
    "megatron_tlt.rl.trainer", "megatron_tlt.drafter.precision", "megatron_tlt.cli",
)
# vLLM's compiled kernels load only against CUDA torch on a driver: a stand-in for the extension and for the
# torch.ops namespaces it registers, holding only the kernels modules call at import, answered as on Hopper.
CUDA_EXTENSION = "vllm._C_stable_libtorch"
KERNEL_NAMESPACES = ("_C", "_C_cache_ops", "_C_custom_ar")
QUERY_KERNELS = {"cutlass_scaled_mm_supports_fp8": True, "cutlass_scaled_mm_supports_block_fp8": True}
# Builds paired with this machine's torch (or its Python): never replaced by the device's version in the check.
HOST_BOUND = {"torch", "torchaudio", "torchvision", "triton", "numpy"}


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def read_list(path: Path) -> dict[str, str | None]:
    """``name`` or ``name==version`` lines (comments after '#') as {canonical name: version or None}."""
    packages = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            packages[canonical(name.split("[")[0])] = version or None
    return packages


def _top_level_entries(dist: metadata.Distribution) -> set[str]:
    files = dist.files or []
    tops = {f.parts[0] for f in files if f.parts and f.parts[0] != ".." and not f.parts[0].endswith(".pth")}
    return tops - {"__pycache__"}


def link_device_view(view: Path, device: dict[str, str | None]) -> list[str]:
    """Links in ``view`` to the host's installed distributions that the device has too; returns their names.
    A namespace folder (no __init__.py) shared by several distributions is made real and filled per owner."""
    linked = []
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if not name or canonical(name) not in device:
            continue
        root = Path(dist.locate_file(""))
        for top in _top_level_entries(dist):
            source, target = root / top, view / top
            if source.is_dir() and not (source / "__init__.py").exists() and not top.endswith((".dist-info", ".libs")):
                target.mkdir(exist_ok=True)
                owned = {f.parts[1] for f in dist.files if len(f.parts) > 2 and f.parts[0] == top}
                for child in owned - {"__pycache__"}:
                    if not (target / child).exists():
                        (target / child).symlink_to(source / child)
            elif source.exists() and not target.exists():
                target.symlink_to(source)
        linked.append(f"{name} {dist.version}")
    return sorted(linked)


class _MissRecorder:
    """Last on sys.meta_path: sees only imports that no finder could satisfy."""

    def __init__(self):
        self.missed: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        if "." not in fullname:  # a package's missing submodule is the package's business
            self.missed.add(fullname)
        return None


class _KernelStub(types.ModuleType):
    """A compiled extension's stand-in, with only QUERY_KERNELS: modules test for any other kernel before they
    register around it, and would register around a stub that claimed to hold it."""

    def __getattr__(self, name):
        if name not in QUERY_KERNELS:
            raise AttributeError(name)
        return lambda *args, **kwargs: QUERY_KERNELS[name]


def _force_cuda_platform() -> None:
    """Choose vLLM's CUDA platform as the device would, its kernels stubbed."""
    import torch

    sys.modules[CUDA_EXTENSION] = _KernelStub(CUDA_EXTENSION)
    for namespace in KERNEL_NAMESPACES:
        setattr(torch.ops, namespace, _KernelStub(namespace))
    import vllm.platforms
    from vllm.platforms import cuda
    from vllm.platforms.interface import DeviceCapability

    class Hopper(cuda.CudaPlatform):  # what modules ask at import, answered as the H200 would
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(major=9, minor=0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H200"

    vllm.platforms._current_platform = Hopper()


def _site_distributions(site: Path) -> dict[str, set[str]]:
    """{distribution in ``site``: its top-level modules}, from the RECORD pip wrote."""
    found = {}
    for record in site.glob("*.dist-info/RECORD"):
        tops = {line.split("/", 1)[0].split(",", 1)[0] for line in record.read_text().splitlines()}
        modules = {t.split(".")[0] for t in tops if not t.endswith((".dist-info", ".data")) and t not in ("..", "bin")}
        found[record.parent.name.split("-")[0]] = modules
    return found


def _import_all(site: Path) -> int:
    """Runs inside the emulated interpreter: import every root, say what failed and what was missed."""
    recorder = _MissRecorder()
    sys.meta_path.append(recorder)
    failed = 0
    steps = [("(CUDA platform chosen)", _force_cuda_platform)]
    steps += [(name, lambda name=name: importlib.import_module(name)) for name in ENGINE_MODULES + PROJECT_MODULES]
    for label, step in steps:
        try:
            step()
            print(f"ok    {label}")
        except Exception as err:  # report every root, not only the first failure
            failed += 1
            print(f"FAIL  {label}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    missed = recorder.missed - set(sys.stdlib_module_names)
    device = read_list(DEVICE_PACKAGES)
    on_device = sorted(m for m in missed if canonical(m) in device)
    print("asked for, absent, import guarded: " + ", ".join(sorted(missed - set(on_device))))
    print("asked for, on the device, no stand-in here: " + (", ".join(on_device) or "none"))
    loaded = {name.split(".")[0] for name in sys.modules}
    unused = sorted(d for d, modules in _site_distributions(site).items() if not modules & loaded)
    print("in SITE, loaded by none of these imports: " + (", ".join(unused) or "none"))
    return failed


def check_imports(site: Path) -> int:
    device = read_list(DEVICE_PACKAGES)
    with tempfile.TemporaryDirectory(prefix="device-view-") as view:
        linked = link_device_view(Path(view), device)
        print(f"device stand-ins from this machine ({len(linked)} of the {len(device)} the device has): "
              + ", ".join(linked))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO), view]),
                   VLLM_USE_FLASHINFER_SAMPLER="0", CUDA_VISIBLE_DEVICES="")
        done = subprocess.run([sys.executable, "-S", __file__, "_import_all", str(site)], env=env, cwd=REPO)
    return done.returncode


def sort_wheels(wheels: Path) -> tuple[list[str], list[str]]:
    """The wheels in ``wheels`` this interpreter loads (paths), and the others (``name==version``): built for
    another Python, their twins built for this one stand in for them in the check."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    here = set(sys_tags())
    loadable, foreign = [], []
    for wheel in sorted(wheels.glob("*.whl")):
        name, version, _, tags = parse_wheel_filename(wheel.name)
        if tags & here:
            loadable.append(str(wheel))
        else:
            foreign.append(f"{name}=={version}")
    return loadable, foreign


def kit_projects(wheels: Path) -> dict[str, Path]:
    from packaging.utils import parse_wheel_filename

    return {canonical(str(parse_wheel_filename(w.name)[0])): w for w in sorted(wheels.glob("*.whl"))}


def device_standins(wheels: Path) -> list[str]:
    """``name==version`` of the device's packages whose version is known and differs from this machine's, the
    kit's own and the torch family (their builds pair with this machine's torch) aside: fetched for the check
    so that what vLLM imports of them is the device's code (huggingface-hub 2.x here imports httpx2, 1.33 there
    does not)."""
    kit = kit_projects(wheels)
    wanted = []
    for name, version in read_list(DEVICE_PACKAGES).items():
        if version is None or name in kit or name in HOST_BOUND:
            continue
        try:
            here = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if here != version:
            wanted.append(f"{name}=={version}")
    return wanted


def undeclared_requirements(wheels: Path) -> list[str]:
    """What the kit's wheels require (extras aside, markers evaluated for the device) that is neither on the
    device nor in the kit: each a deliberate leave-out or a gap, for a reader to judge."""
    import zipfile

    from packaging.requirements import Requirement

    device = read_list(DEVICE_PACKAGES)
    environment = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                   "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
                   "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
    kit = kit_projects(wheels)
    gaps = []
    for name, wheel in sorted(kit.items()):
        with zipfile.ZipFile(wheel) as archive:
            meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            lines = archive.read(meta).decode().splitlines()
        for line in lines:
            if not line.startswith("Requires-Dist:"):
                continue
            requirement = Requirement(line.split(":", 1)[1].strip())
            if requirement.marker is not None and not requirement.marker.evaluate(environment):
                continue
            wanted = canonical(requirement.name)
            if wanted not in device and wanted not in kit:
                gaps.append(f"{name} -> {requirement}")
    return gaps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("imports", "requires", "loadable", "foreign", "standins", "_import_all"))
    parser.add_argument("path", nargs="?", type=Path)
    args = parser.parse_args()
    if args.path is None:
        parser.error(f"{args.what} needs a folder")
    if args.what == "_import_all":
        return min(_import_all(args.path), 1)
    if args.what == "imports":
        return check_imports(args.path)
    if args.what in ("loadable", "foreign"):
        lines = sort_wheels(args.path)[args.what == "foreign"]
    else:
        lines = device_standins(args.path) if args.what == "standins" else undeclared_requirements(args.path)
    if lines:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
