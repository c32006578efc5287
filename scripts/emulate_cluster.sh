#!/usr/bin/env bash
# Emulate a multi-host cluster on this machine and check `dpscale predict` against it.
#
#   sudo scripts/emulate_cluster.sh [--hosts 2] [--workers-per-host 1] [--rate-gbit 1] [--transport gloo]
#
# Builds one network namespace per host plus a switch namespace (veth pairs to a bridge, addresses
# 10.213.0.x inside the namespaces only), caps every link with `tc ... tbf rate`, runs one torchrun
# per host namespace (c10d rendezvous on the first host), then deletes everything, also on failure.
# The work is done by src/dpscale/predict/emulate.py; this is the command-line entry point.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
exec "$python" "$root/benchmarks/predict_validation.py" emulate "$@"
