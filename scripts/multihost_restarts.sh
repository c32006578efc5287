#!/usr/bin/env bash
# How often a killed worker on one of two emulated hosts recovers bit-exactly with --max-restarts 1
# (#20): runs tests/multihost/test_train_two_hosts.py::test_a_killed_worker_on_one_host_recovers_bit_exactly
# N times (default 10), each on fresh namespaces, and prints "k/N recovered". Needs root (ip netns).
# Usage: scripts/multihost_restarts.sh [N]
set -u
n=${1:-10}
cd "$(dirname "$0")/.."
test=tests/multihost/test_train_two_hosts.py::test_a_killed_worker_on_one_host_recovers_bit_exactly
ok=0
for i in $(seq 1 "$n"); do
  start=$(date +%s)
  if .venv/bin/python -m pytest -q -p no:cacheprovider "$test" >"/tmp/multihost_restarts.$$.$i.log" 2>&1; then
    ok=$((ok + 1)); verdict=recovered
  else
    verdict="FAILED (log: /tmp/multihost_restarts.$$.$i.log)"
  fi
  echo "try $i: $verdict in $(( $(date +%s) - start )) s"
done
echo "$ok/$n recovered bit-exactly ($(date -u +%Y-%m-%dT%H:%MZ), load: $(cut -d' ' -f1-3 /proc/loadavg))"
[ "$ok" -eq "$n" ]
