#!/usr/bin/env bash
# What has to hold on a GPU (tests/gpu and the GPU benchmarks), run in one go on one CUDA device, each part
# bounded in time so that a hang costs that part only. Figures and logs land in OUT_DIR, one file a part.
#
#   bash launch/gpu_acceptance.sh kernels OUT_DIR   # needs no vLLM: the suite's Megatron, drafter, NVML and
#                                                   # planner tests, the FP8 drafter bench, the 70B-TP8 step kernels
#   bash launch/gpu_acceptance.sh loop OUT_DIR      # needs GPU vLLM: the engine tests, tlt train, weight sync GB/s,
#                                                   # and TLT off vs on end to end (bench/tlt_end_to_end.py)
#   bash launch/gpu_acceptance.sh all OUT_DIR
#
# E2E_STEPS (default 8) sets the end-to-end run's steps per arm (the first step of each is left out of its times),
# E2E_SECONDS (default 300) its time limit.
# `tlt` must be on PATH (pip install -e .), megatron-core and, for `loop`, vLLM installed (launch/install_gpu.sh).
set -uo pipefail

phase=${1:?usage: gpu_acceptance.sh kernels|loop|all OUT_DIR}
out=${2:?usage: gpu_acceptance.sh kernels|loop|all OUT_DIR}
case $phase in kernels | loop | all) ;; *) echo "unknown phase '$phase': kernels, loop or all" >&2; exit 2 ;; esac
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 1
failed=0

# part NAME SECONDS COMMAND...: run COMMAND with its output in OUT_DIR/NAME.log, killed after SECONDS.
part() {
    local name=$1 limit=$2 started rc
    shift 2
    started=$(date +%s)
    echo "== $name: $*"
    timeout --signal=INT --kill-after=30 "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    echo "== $name: exit $rc after $(($(date +%s) - started)) s$([ "$rc" = 124 ] && echo " (timed out)")"
    tail -n 25 "$out/$name.log"
    [ "$rc" = 0 ] || failed=1
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
python3 - <<'EOF'
import importlib.metadata as metadata
for name in ("vllm", "megatron-core", "transformers", "torchao", "transformer-engine"):
    try:
        print(name, metadata.version(name))
    except metadata.PackageNotFoundError:
        print(name, "not installed")
EOF

if [ "$phase" != loop ]; then
    part suite_kernels 150 python3 -m pytest -q -rs -p no:cacheprovider --timeout 240 \
        tests/gpu/test_megatron_on_cuda.py tests/gpu/test_drafter_on_cuda.py tests/gpu/test_nvml_idle_gate.py \
        tests/gpu/test_plan_vs_measured_on_cuda.py
    part drafter_precision 120 python3 bench/drafter_precision.py --out "$out/drafter_precision.json"
    part step_costs_70b_tp8 150 python3 bench/gpu_step_cost.py --shape llama-3.3-70b-tp8 \
        --batches 1,2,4,8,16,32,64,128 --depths 0,1,2,3,4,5,6,8 --context 2048 --repeats 10 \
        --out "$out/step_costs_70b_tp8.json"
fi
if [ "$phase" != kernels ]; then
    part suite_loop 280 python3 -m pytest -q -rs -p no:cacheprovider --timeout 240 \
        tests/gpu/test_vllm_on_cuda.py tests/gpu/test_tlt_train_on_cuda.py
    part weight_sync 90 python3 bench/weight_sync.py --hidden 4096 --layers 8 --repeats 3
    rm -rf /tmp/tlt-e2e
    # One rank on one GPU (NCCL takes one GPU a rank), so no rank is ever idle: TLT on is speculation with a
    # drafter that does not train there. The cold-start drafter's cache key holds the parallel layout, so the
    # shipped one (made at two ranks, of the same initial policy) is named rather than remade.
    shipped_drafter=$(ls -d megatron_tlt/rl/tiny/shipped/drafter-*)
    part tlt_end_to_end "${E2E_SECONDS:-300}" python3 bench/tlt_end_to_end.py --steps "${E2E_STEPS:-8}" \
        --no-frozen --no-serial --drafter "$shipped_drafter" --keep /tmp/tlt-e2e -- parallel.data_parallel_size=1
    for log in /tmp/tlt-e2e/*/logs/rank0.log; do  # what each run said: held-out accuracy, TLT lines, errors
        [ -f "$log" ] && { echo "== $log"; grep -E "held-out|TLT:|ERROR|Error|step [0-9]+ " "$log" | tail -n 30; }
    done >"$out/tlt_end_to_end_runs.log"
    # every run's summary.json and rank logs, complete or cut short, for the ratios to be read back later
    tar -czf "$out/tlt_end_to_end_runs.tgz" -C /tmp tlt-e2e 2>/dev/null
fi
exit $failed
