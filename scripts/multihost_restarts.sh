#!/usr/bin/env bash
# How often a killed worker on one of two emulated hosts recovers bit-exactly with --max-restarts 1
# (#20, #34): runs tests/multihost/test_train_two_hosts.py::test_a_killed_worker_on_one_host_recovers_every_time
# N times (default 20), each try on fresh namespaces, against one one-host reference per batch, and
# prints "k/N recovered". Needs root (ip netns).
#
# Usage: [LOAD=K] [BATCH=B] [LOCK=FILE] [LOGS=DIR] scripts/multihost_restarts.sh [N]
#   LOAD   busy processes (`while 1: pass`) beside the tries, e.g. one per core (default 0)
#   BATCH  tries per pytest run (default: all N); each batch computes its own reference
#   LOCK   flock FILE around each batch (a shared host's heavy-run lock)
#   LOGS   where both hosts' output of every failed try is kept (default: a new /tmp dir)
# PYTHON (default .venv/bin/python) runs pytest; PYTHONPATH passes through.
set -u
n=${1:-20}
batch=${BATCH:-$n}
load=${LOAD:-0}
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
logs=${LOGS:-$(mktemp -d /tmp/multihost_restarts.XXXXXX)}
mkdir -p "$logs"
test=tests/multihost/test_train_two_hosts.py::test_a_killed_worker_on_one_host_recovers_every_time
ok=0 done=0 b=0
while [ "$done" -lt "$n" ]; do
  b=$((b + 1)); size=$(( n - done < batch ? n - done : batch ))
  out="$logs/batch$b"
  # the load only while this batch runs (a lock may keep it waiting), ended however the batch ends
  run="trap 'kill \$(jobs -p) 2>/dev/null' EXIT; trap 'exit 143' TERM INT;"
  run+=" for _ in \$(seq 1 $load); do $python -c 'while 1: pass' & done;"
  run+=" DPSCALE_RESTART_TRIES=$size DPSCALE_MULTIHOST_LOG_DIR='$out' $python -m pytest -p no:cacheprovider"
  run+=" -v -m stress '$test' > '$out.log' 2>&1"
  start=$(date +%s)
  if [ -n "${LOCK:-}" ]; then flock "$LOCK" bash -c "$run"; else bash -c "$run"; fi
  passed=$(grep -c 'recovers_every_time\[[0-9]*\] PASSED' "$out.log")
  ok=$((ok + passed)); done=$((done + size))
  # keep the logs of the failed tries only
  for dir in "$out"/*; do
    [ -d "$dir" ] || continue
    try=${dir##*-}
    if grep -q "recovers_every_time\[$try\] PASSED" "$out.log"; then rm -rf "$dir"; fi
  done
  echo "batch $b: $passed/$size recovered in $(( $(date +%s) - start )) s (load $(cut -d' ' -f1 /proc/loadavg)); $out.log"
done
echo "$ok/$n recovered bit-exactly ($(date -u +%Y-%m-%dT%H:%MZ)); failed tries' logs under $logs"
[ "$ok" -eq "$n" ]
