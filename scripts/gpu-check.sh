#!/usr/bin/env bash
# GPU checks for dpscale, in one run of under 400 s on one GPU (docs/engine.md, "The GPU path").
# Runs with that machine's own python3 and PyTorch straight from the source tree (nothing is
# installed; pytest, hypothesis, matplotlib, scikit-learn and rich may be missing):
#   env        torch / CUDA / driver versions and the device's name
#   cuda-tests the CUDA-marked test files (pytest -m cuda); skipped, with a note, without pytest
#   bench      a 124 M-parameter decoder, dpscale vs torch DDP on NCCL at world size 1
#              (scripts/gpu_engine_bench.py): step ms from CUDA events, CPU ms and syncs per step
#   train      `dpscale train --task` on the GPU in bf16 past step 100: 120 steps with a
#              checkpoint at 60, then --resume to 150, the resumed run checked
#   predict    `dpscale profile --device cuda` feeding `dpscale predict --preset dgx-h200`
# Each stage runs under its own timeout in its own process group; whatever is left of a stage
# (a rank child included) is killed when it ends and when this script exits. Writes
# gpu-check.json (every stage, pass/fail/skip, the figures) and exits non-zero on any failure.
# Usage: scripts/gpu-check.sh [OUTPUT_DIR]   (default: $OUT if set, else reports/gpu-check)
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out="${1:-${OUT:-reports/gpu-check}}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
stages="$out/stages.tsv"
: >"$stages"
set -m # each background stage leads its own process group: killed whole, children included
current=""

cleanup() {
    if [ -n "$current" ]; then kill -TERM -- "-$current" 2>/dev/null; sleep 1; kill -KILL -- "-$current" 2>/dev/null; fi
}
trap cleanup EXIT
trap 'cleanup; exit 130' INT TERM

# stage NAME TIMEOUT_S COMMAND...: runs COMMAND (output in NAME.txt), records status and seconds
budget=395 # seconds for every stage together (the whole check: under 400 s)
stage() {
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    # a stage gets its own limit, or what is left of the budget if that is less
    [ "$limit" -le $((budget - SECONDS)) ] || limit=$((budget - SECONDS))
    if [ "$limit" -lt 5 ]; then
        printf '%s\tfail\t124\t0\tno time left in the %ss budget\n' "$name" "$budget" >>"$stages"
        echo "== $name: not run (no time left)"
        return
    fi
    echo "== $name (at most ${limit}s)"
    timeout -k 5 "$limit" "$@" >"$out/$name.txt" 2>&1 &
    current=$!
    wait "$current"
    rc=$?
    kill -KILL -- "-$current" 2>/dev/null # anything the stage left behind
    current=""
    tail -n 5 "$out/$name.txt"
    local status=pass
    [ "$rc" = 0 ] || status=fail
    [ "$rc" = 124 ] && status=timeout
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$((SECONDS - t0))" >>"$stages"
}

skip() { printf '%s\tskip\t0\t0\t%s\n' "$1" "$2" >>"$stages"; echo "== $1: skipped ($2)"; }

# a background job reads no heredoc: each inline program goes in a variable, run with -c
env_py=$(
    cat <<'PY'
import json, platform, subprocess, sys
import torch
env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
       "cuda_available": torch.cuda.is_available(), "gpus": torch.cuda.device_count()}
if torch.cuda.is_available():
    env["device_name"] = torch.cuda.get_device_name(0)
    nccl = torch.cuda.nccl.version()  # a tuple in recent releases, an int in older ones
    env["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
try:
    env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=20).stdout.split("\n")[0].strip()
except (OSError, subprocess.SubprocessError):
    env["driver"] = None
json.dump(env, open(sys.argv[1], "w"), indent=2)
print(json.dumps(env))
sys.exit(0 if env["cuda_available"] else 1)
PY
)
stage env 20 python3 -c "$env_py" "$out/env.json"

# only the files that hold CUDA tests: collecting the whole suite would import what is missing here
cuda_files=$(grep -rlE "mark\.cuda|pytestmark.*cuda" tests --include='test_*.py' | sort)
if ! python3 -c "import pytest" 2>/dev/null; then
    skip cuda-tests "pytest is not installed"
elif [ -z "$cuda_files" ]; then
    skip cuda-tests "no CUDA test files"
else
    # shellcheck disable=SC2086 # one word per file
    stage cuda-tests 100 python3 -m pytest -q -p no:cacheprovider -m cuda $cuda_files
fi

stage bench 120 python3 scripts/gpu_engine_bench.py --out "$out"

export root ckpt="$out/train-ckpt"
rm -rf "$ckpt"
# the task module is found from examples/ (the current directory); exported, for `timeout bash -c`
train() {
    cd "$root/examples" && exec python3 -m dpscale.cli.main train --task own_task:make --device cuda \
        --precision bf16 --nproc 1 --epochs 1000 --checkpoint-dir "$ckpt" --checkpoint-every 60 \
        --progress none --json "$@"
}
export -f train
stage train 50 bash -c 'train --max-steps 120'
stage train-resume 40 bash -c 'train --max-steps 150 --resume'

stage profile 45 python3 -m dpscale.cli.main profile --model transformer --device cuda \
    --per-worker-batch 64 --steps 10 --warmup 3 --out "$out/profile.json"
stage predict 20 python3 -m dpscale.cli.main predict --profile "$out/profile.json" --preset dgx-h200 --json

# one JSON of figures (scripts/gpu_check_report.py); a failed check there fails the run too
python3 scripts/gpu_check_report.py "$out"
status=$?
echo "gpu-check: $([ $status = 0 ] && echo ok || echo FAILED); $out/gpu-check.json"
exit $status
