#!/usr/bin/env bash
# Run `tlt train` on one node under torchrun: one process per GPU, every rank running the trainer.
#
#   launch/torchrun_single_node.sh [options] [--] [key=value ...]
#
#   --config NAME|PATH     config name under launch/configs or a YAML path (default: $TLT_CONFIG or tiny)
#   --nproc-per-node N     ranks to start (default: $NPROC_PER_NODE, else every visible GPU; on a machine
#                          without GPUs, the config's own world size tp x pp x dp)
#   --run-dir DIR          run directory of a new run (default: $RUN_DIR, else runs/<time stamp>)
#   --resume RUN_DIR       continue the run in RUN_DIR from its latest checkpoint (its config.yaml is used)
#   --log-dir DIR          torchrun's copy of each rank's console: progress and errors (default: $LOG_DIR,
#                          else <run dir>.logs beside the run directory); the full rank logs are in <run dir>/logs
#   --dry-run              print the environment and the exact command instead of running it
#   key=value ...          config overrides, passed through to `tlt train`
#
# parallel.data_parallel_size is set to N / (tp x pp) unless given, so the world torchrun starts is the
# world the config asks for. Environment: PYTHON (python3), TORCHRUN (torchrun), OMP_NUM_THREADS.
set -euo pipefail

PROG=$(basename "$0")
PYTHON=${PYTHON:-python3}
TORCHRUN=${TORCHRUN:-torchrun}

die() { echo "$PROG: error: $*" >&2; exit 2; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }

config=${TLT_CONFIG:-tiny}
nproc=${NPROC_PER_NODE:-}
run_dir=${RUN_DIR:-}
log_dir=${LOG_DIR:-}
resume_dir=""
dry_run=0
overrides=()
while (($#)); do
  case $1 in
    --config) [[ $# -ge 2 ]] || die "--config needs a value"; config=$2; shift 2 ;;
    --config=*) config=${1#*=}; shift ;;
    --nproc-per-node | --nproc) [[ $# -ge 2 ]] || die "$1 needs a value"; nproc=$2; shift 2 ;;
    --nproc-per-node=* | --nproc=*) nproc=${1#*=}; shift ;;
    --run-dir) [[ $# -ge 2 ]] || die "--run-dir needs a value"; run_dir=$2; shift 2 ;;
    --run-dir=*) run_dir=${1#*=}; shift ;;
    --resume) [[ $# -ge 2 ]] || die "--resume needs a run directory"; resume_dir=$2; shift 2 ;;
    --resume=*) resume_dir=${1#*=}; shift ;;
    --log-dir) [[ $# -ge 2 ]] || die "--log-dir needs a value"; log_dir=$2; shift 2 ;;
    --log-dir=*) log_dir=${1#*=}; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; overrides+=("$@"); break ;;
    -*) die "unknown option $1 (see --help)" ;;
    *=*) overrides+=("$1"); shift ;;
    *) die "unexpected argument '$1': overrides look like key=value" ;;
  esac
done

# Every visible GPU, as torchrun would see them.
visible_gpus() {
  if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then
    local devices
    IFS=, read -r -a devices <<<"$CUDA_VISIBLE_DEVICES"
    echo "${#devices[@]}"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}

if [[ -n $resume_dir ]]; then
  [[ -z $run_dir ]] || die "--run-dir and --resume exclude each other (a resumed run keeps its directory)"
  [[ -f $resume_dir/config.yaml ]] || die "$resume_dir: not a run directory (config.yaml missing)"
  run_dir=$resume_dir
  config_source=$resume_dir/config.yaml
else
  run_dir=${run_dir:-runs/$(date +%Y%m%d-%H%M%S)}
  config_source=$config
fi
log_dir=${log_dir:-${run_dir%/}.logs}
if [[ -z $nproc ]]; then
  nproc=$(visible_gpus)
  gpus_seen=$nproc
else
  [[ $nproc =~ ^[1-9][0-9]*$ ]] || die "--nproc-per-node must be a positive integer, got '$nproc'"
  gpus_seen=""
fi

# The layout: tp x pp from the config (with overrides), dp = ranks / (tp x pp), checked by load_config.
# Prints "tp pp dp"; with 0 ranks (no GPU seen) the config's own world is kept.
layout=$("$PYTHON" - "$config_source" "$nproc" "${overrides[@]}" <<'PY'
import sys

from megatron_tlt.config import load_config

source, nproc, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
try:
    config = load_config(source, overrides)
    tp, pp = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
    dp = config.parallel.data_parallel_size
    dp_given = any(o.split("=", 1)[0] == "parallel.data_parallel_size" for o in overrides)
    if nproc and not dp_given:
        if nproc % (tp * pp):
            raise ValueError(f"{nproc} ranks are not a multiple of tensor_parallel_size {tp} x "
                             f"pipeline_parallel_size {pp}")
        dp = nproc // (tp * pp)
        load_config(source, overrides + [f"parallel.data_parallel_size={dp}"])  # e.g. prompts_per_step % dp
    if nproc and tp * pp * dp != nproc:
        raise ValueError(f"the config's world is tp {tp} x pp {pp} x dp {dp} = {tp * pp * dp}, "
                         f"but {nproc} ranks would be started")
except ValueError as err:
    sys.exit(f"error: {err}")
print(tp, pp, dp)
PY
) || die "the layout does not fit (see above)"
read -r tp pp dp <<<"$layout"
world=$((tp * pp * dp))
if [[ $nproc == 0 ]]; then
  nproc=$world
  echo "$PROG: no GPU visible: starting the config's world of $world ranks (tp $tp x pp $pp x dp $dp)" >&2
elif [[ -n $gpus_seen ]]; then
  echo "$PROG: $nproc visible GPUs: tp $tp x pp $pp x dp $dp" >&2
fi

# One process per rank, each with its share of the cores (torchrun would otherwise set 1 thread).
cores=$(nproc 2>/dev/null || echo 1)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((cores / nproc > 0 ? cores / nproc : 1))}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # Megatron's TP comm ordering
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # a hung collective ends the job
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export PYTHONUNBUFFERED=1
exported=(OMP_NUM_THREADS CUDA_DEVICE_MAX_CONNECTIONS TORCH_NCCL_ASYNC_ERROR_HANDLING NCCL_DEBUG PYTHONUNBUFFERED)

if [[ -n $resume_dir ]]; then
  train_args=(train --resume "$resume_dir")
else
  train_args=(train --config "$config" "trainer.run_dir=$run_dir")
fi
train_args+=("${overrides[@]}" "parallel.data_parallel_size=$dp")

command=("$TORCHRUN" --standalone --nnodes=1 "--nproc-per-node=$nproc" --max-restarts=0
  "--log-dir=$log_dir" --tee=3 -m megatron_tlt.cli "${train_args[@]}")

if ((dry_run)); then
  echo "# $PROG dry run: run directory $run_dir, per-rank logs under $log_dir"
  for name in "${exported[@]}"; do
    printf 'export %s=%q\n' "$name" "${!name}"
  done
  printf '%q ' "${command[@]}"
  printf '\n'
  exit 0
fi
mkdir -p "$log_dir"
echo "$PROG: run directory $run_dir, per-rank logs under $log_dir" >&2
exec "${command[@]}"
