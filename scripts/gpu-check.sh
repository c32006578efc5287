#!/usr/bin/env bash
# GPU checks for dpscale, in one short run (< 5 min) on a machine with CUDA.
# Runs with that machine's own python3 and PyTorch straight from the source tree (nothing is
# installed): the CUDA-marked tests, then a one-GPU throughput comparison of dpscale's engine
# against torch DDP on NCCL, and with 2+ GPUs the engine on NCCL at world size 2; then
# `dpscale train --task` (examples/own_task.py) on the GPU(s) in bf16.
# Usage: scripts/gpu-check.sh [OUTPUT_DIR]   (default: $OUT if set, else reports/gpu-check)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-reports/gpu-check}}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 - <<'PY' | tee "$out/environment.txt"
import torch, platform
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("gpus", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
PY
status=0
timeout 180 python3 -m pytest -q -p no:cacheprovider -m cuda tests 2>&1 | tee "$out/cuda-tests.txt" || status=1
timeout 120 python3 scripts/gpu_engine_bench.py --out "$out" 2>&1 | tee "$out/engine-bench.txt" || status=1
# a user task (examples/own_task.py) trained on the GPU(s): NCCL, bf16 autocast, the JSON summary
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
(cd examples && timeout 120 python3 -m dpscale.cli.main train --task own_task:make --device cuda --precision bf16 \
    --nproc "$(( ngpu > 1 ? 2 : 1 ))" --epochs 2 --progress none --json) 2>&1 | tee "$out/train-task.txt" || status=1
echo "gpu-check: $([ $status = 0 ] && echo ok || echo FAILED); outputs in $out"
exit $status
