#!/usr/bin/env bash
# Build the GPU kit from nothing, on a CPU machine with network: what the lent H200 (no network; Python 3.12,
# torch 2.11.0+cu130, its packages in launch/gpu_device_packages.txt) needs to run GPU vLLM and megatron-tlt,
# as wheels cut into parts that each fit one device call. launch/gpu_kit_install.sh installs them there.
#
#   bash launch/gpu_kit.sh [DIR]               # DIR: default .gpu_kit here (git ignores it); carry from there
#   bash launch/gpu_kit.sh --split-only [DIR]  # cut DIR/wheels into parts again (no network, no check)
#
# 1. fetch: the wheels pinned in launch/gpu_kit.pins, without their dependencies, for CPython 3.12 on manylinux
#    x86_64, into DIR/download;
# 2. slim GPU vLLM to what an fp32/bf16 EAGLE engine loads (SLIM_DROP below: FlashAttention 2 and 3, the MoE
#    kernels, the Rust server, JIT headers for FP8 and Blackwell, extensions for other Pythons), and patch out
#    vllm_flash_attn's import guard, which refuses to import without FA2/FA3 though fp32 engines take Triton
#    attention; repacked with `wheel pack` (RECORD rewritten) into DIR/wheels beside the other wheels;
# 3. check here what can be checked without a GPU (launch/gpu_kit_check.py; GPU_KIT_CHECK=0 skips it): what
#    the wheels declare that neither the device nor the kit holds (printed, for a reader to judge), and that
#    the engine's and our GPU-side modules import with only the device's packages and the kit on the path, the
#    CUDA platform chosen and its compiled kernels stubbed. Not checked: that the CUDA extensions load against
#    torch 2.11+cu130 on the driver, the device's exact versions of torch, triton and numpy (this machine's
#    stand in), imports made only at run time. The check installs the kit for this machine's Python into
#    DIR/check (twins of the 3.12-only wheels, and the device's versions of its pure-Python packages);
# 4. split: DIR/wheels into DIR/part-1 ... of at most GPU_KIT_PART_MIB each, with MANIFEST.tsv (part, bytes,
#    sha256, piece, the file it makes). Default: what the working tree leaves of a call's 64 MiB, less 2 MiB,
#    since every call carries the tree too.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
split_only=0
if [[ ${1:-} == --split-only ]]; then split_only=1; shift; fi
dir=$(realpath -m "${1:-$repo/.gpu_kit}")
PINS=$repo/launch/gpu_kit.pins
WHEEL_TOOL=wheel==0.48.0  # wheel unpack/pack: the repack of vLLM, run from its own wheel here
PLATFORMS=(manylinux1_x86_64 manylinux2014_x86_64)
for glibc in $(seq 17 39); do PLATFORMS+=("manylinux_2_${glibc}_x86_64"); done  # the device's glibc is 2.39
# vLLM 0.26.0's wheel, left out (MiB as compressed in the wheel, 290 MiB in all; unzip -v)
SLIM_DROP=(
  vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so  # 123.5: FlashAttention 2 (refuses fp32)
  vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so  # 36.6: FlashAttention 3
  vllm/_moe_C_stable_libtorch.abi3.so       # 39.0: MoE kernels (dense models here)
  vllm/vllm-rs                              # 14.9: the Rust API server
  vllm/third_party/fmha_sm100/cutlass       # 3.4: Blackwell attention's JIT headers
  vllm/third_party/deep_gemm/include        # 2.9: DeepGEMM's FP8 JIT headers
  vllm/third_party/deep_gemm/_C.cpython-310-x86_64-linux-gnu.so  # 2.1 for these four: other Pythons
  vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so
  vllm/third_party/deep_gemm/_C.cpython-313-x86_64-linux-gnu.so
  vllm/third_party/deep_gemm/_C.cpython-314-x86_64-linux-gnu.so
)
GUARD='if not (FA2_AVAILABLE or FA3_AVAILABLE):'
pip_quiet() {  # pip, less the warnings about this machine's local package folders; its status kept
  local output rc=0
  output=$(nice -n 19 python3 -m pip --disable-pip-version-check -q "$@" 2>&1) || rc=$?
  grep -v -e "^WARNING: Location" -e "^WARNING: Running pip as the 'root' user" -e "^$" <<<"$output" >&2 || true
  return "$rc"
}
mib() { du -cb "$@" | awk 'END {printf "%.1f", $1 / 1048576}'; }

tree_mib() {  # what every device call carries besides the part: tracked and untracked-not-ignored files
  git -C "$repo" ls-files -z -co --exclude-standard | (cd "$repo" && xargs -0 stat -c %s 2>/dev/null) \
    | awk '{s += $1} END {printf "%d", s / 1048576 + 1}'
}

fetch() {
  rm -rf "$dir/download" "$dir/wheels" "$dir/build" "$dir/check"
  mkdir -p "$dir/download" "$dir/wheels" "$dir/tools"
  local platform_args=() platform
  for platform in "${PLATFORMS[@]}"; do platform_args+=(--platform "$platform"); done
  echo "gpu_kit: fetching $(grep -cE '^[A-Za-z]' "$PINS") pinned wheels for CPython 3.12 (launch/gpu_kit.pins)"
  pip_quiet download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platform_args[@]}" -d "$dir/download" -r "$PINS"
  [[ $(find "$dir/download" -name '*.whl' | wc -l) == $(grep -cE '^[A-Za-z]' "$PINS") ]] || {
    echo "gpu_kit: pip fetched $(find "$dir/download" -name '*.whl' | wc -l) wheels for the pins above" >&2; exit 1; }
  pip_quiet download --no-deps --only-binary=:all: -d "$dir/tools" "$WHEEL_TOOL"
}

slim_vllm() {
  local original tree wheel_tool path
  original=$(find "$dir/download" -name 'vllm-*.whl')
  wheel_tool=$(find "$dir/tools" -name "wheel-${WHEEL_TOOL#*==}-*.whl")
  mkdir -p "$dir/build"
  PYTHONPATH=$wheel_tool nice -n 19 python3 -m wheel unpack -d "$dir/build" "$original" >/dev/null
  tree=$(find "$dir/build" -mindepth 1 -maxdepth 1 -type d)
  for path in "${SLIM_DROP[@]}"; do
    [[ -e $tree/$path ]] || { echo "gpu_kit: $path is not in $original: a vLLM other than the pin?" >&2; exit 1; }
    rm -rf "${tree:?}/$path"
  done
  python3 - "$tree/vllm/vllm_flash_attn/__init__.py" "$GUARD" <<'PY'
import sys

path, guard = sys.argv[1], sys.argv[2]
text = open(path).read()
if text.count(guard) != 1:
    sys.exit(f"gpu_kit: {path} has not the one import guard expected ({guard!r})")
start = text.index(guard)
end = text.index("\n    )\n", start) + len("\n    )\n")  # the guard's raise ImportError(...)
note = "# gpu_kit.sh: guard removed; FA2 and FA3 are left out of this build, fp32 engines take Triton attention\n"
open(path, "w").write(text[:start] + note + text[end:])
PY
  PYTHONPATH=$wheel_tool nice -n 19 python3 -m wheel pack -d "$dir/wheels" "$tree" >/dev/null
  rm -rf "$dir/build"
  find "$dir/download" -name '*.whl' ! -name 'vllm-*' -exec cp {} "$dir/wheels/" \;
  echo "gpu_kit: vLLM slimmed from $(mib "$original") to $(mib "$dir"/wheels/vllm-*.whl) MiB;" \
       "the kit is $(mib "$dir"/wheels/*.whl) MiB in $(find "$dir/wheels" -name '*.whl' | wc -l) wheels"
}

check() {
  local check=$dir/check spec loadable=() extra=()
  mkdir -p "$check/extra"
  mapfile -t loadable < <(python3 "$repo/launch/gpu_kit_check.py" loadable "$dir/wheels")
  mapfile -t extra < <(python3 "$repo/launch/gpu_kit_check.py" foreign "$dir/wheels"
                       python3 "$repo/launch/gpu_kit_check.py" standins "$dir/wheels")
  for spec in "${extra[@]}"; do
    pip_quiet download --no-deps --only-binary=:all: -d "$check/extra" "$spec" \
      || echo "gpu_kit: no wheel of $spec for this Python: this machine's own stands in"
  done
  pip_quiet install --no-index --no-deps --no-compile --target "$check/site" "${loadable[@]}" "$check"/extra/*.whl
  echo "gpu_kit: declared by the kit's wheels, neither on the device nor in the kit (left out; a gap if an" \
       "engine imports it):"
  python3 "$repo/launch/gpu_kit_check.py" requires "$dir/wheels" | sed 's/^/  /'
  echo "gpu_kit: the imports, emulated (here for this Python, or at the device's version: ${extra[*]})"
  local rc=0
  nice -n 19 python3 "$repo/launch/gpu_kit_check.py" imports "$check/site" >"$check/imports.log" 2>&1 || rc=$?
  grep -E "^(ok|FAIL|asked for|in SITE|device stand-ins)" "$check/imports.log" | cut -c1-400
  if ((rc == 0)); then echo "gpu_kit: import check passed"
  else echo "gpu_kit: import check FAILED (all it printed: $check/imports.log)"; fi
  return "$rc"
}

split() {
  local part_mib tree
  tree=$(tree_mib)
  part_mib=${GPU_KIT_PART_MIB:-$((64 - tree - 2))}
  echo "gpu_kit: parts of at most $part_mib MiB (a call carries 64 MiB; the working tree is $tree MiB)"
  python3 "$repo/launch/gpu_kit_parts.py" split "$dir/wheels" "$dir" \
    --part-bytes "$(python3 -c "import sys; print(int(float(sys.argv[1]) * 2**20))" "$part_mib")"
}

started=$(date +%s)
if ((split_only == 0)); then
  fetch
  slim_vllm
  if [[ ${GPU_KIT_CHECK:-1} != 0 ]]; then
    check_status=0
    check || check_status=$?
  fi
fi
split
parts=$(find "$dir" -maxdepth 1 -name 'part-*' | wc -l)
rel=${dir#"$repo"/}
echo "gpu_kit: $(mib "$dir"/wheels/*.whl) MiB in $parts parts, made in $(($(date +%s) - started)) s. On the device" \
     "(launch/gpu_kit_install.sh says more), one call per part, back to back:"
for ((k = 1; k <= parts; k++)); do
  echo "  run(carry=[\"$rel/part-$k\"], command=\"bash launch/gpu_kit_install.sh $rel\")"
done
[[ $rel != "$dir" ]] || echo "gpu_kit: $dir is outside the repository: move it to .gpu_kit to carry it" >&2
exit "${check_status:-0}"
