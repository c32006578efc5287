"""`dpscale train`'s workers forked from a preloaded server against started afresh, A vs B.

    flock /tmp/dpscale-bench.lock python benchmarks/worker_start.py [--rounds 6] [--json out.json]

Each round runs two commands per variant, the variants alternating (which goes first rotates):

- `short`: `dpscale train --workload synthetic --nproc 2 --max-steps 5` (start, five steps, end:
  what a short job, a test, or a `scale` point pays to start);
- `restart`: the same with 30 steps, `--max-restarts 1` and rank 1 killed at step 10 of the first
  attempt (dpscale.testing.faults): the agent stops the survivor and starts both workers again.

Variants (launch/fork_start.py, DPSCALE_WORKER_START): `fork` (the default: the command starts
multiprocessing's forkserver before it imports torch; the agent forks each worker from it) and
`exec` (each worker is `python -m dpscale.launch.worker`, importing torch itself). Figures of
record: per command and variant the median wall time over rounds with p10-p90, and the fork/exec
ratio of the medians. The parameters each run ends with are checked equal across variants.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from dpscale.lab.bench.rounds import quantile

COMMANDS = {
    "short": (["--max-steps", "5"], None),
    "restart": (["--max-steps", "30", "--max-restarts", "1"], "kill@step=10,rank=1,attempt=0"),
}
VARIANTS = ("fork", "exec")


def run(variant: str, command: str) -> tuple[float, str]:
    flags, faults = COMMANDS[command]
    env = dict(os.environ, DPSCALE_WORKER_START=variant)
    if faults:
        env.update(DPSCALE_FAULTS=faults, DPSCALE_CALLBACKS="dpscale.testing.faults:FaultInjector")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "dpscale.cli.main", "train", "--workload", "synthetic", "--nproc", "2"]
        cmd += [
            *flags,
            "--checkpoint-dir",
            f"{tmp}/ck",
            "--checkpoint-every",
            "5",
            "--json",
            "--progress",
            "none",
        ]
        start = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        wall = time.monotonic() - start
    if p.returncode != 0:
        raise SystemExit(f"{variant} {command} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return wall, json.loads(p.stdout.strip().splitlines()[-1])["param_sha256"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    times: dict[tuple[str, str], list[float]] = {(v, c): [] for v in VARIANTS for c in COMMANDS}
    params: dict[str, set[str]] = {c: set() for c in COMMANDS}
    for r in range(args.rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for command in COMMANDS:
            for variant in order:
                wall, sha = run(variant, command)
                times[variant, command].append(wall)
                params[command].add(sha)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    rows = []
    for command in COMMANDS:
        assert len(params[command]) == 1, f"{command}: the variants ended with different parameters"
        med = {v: statistics.median(times[v, command]) for v in VARIANTS}
        for v in VARIANTS:
            ts = times[v, command]
            spread = f"{quantile(ts, 0.1):.2f}-{quantile(ts, 0.9):.2f}"
            print(f"{command:8s} {v:5s} median {med[v]:6.2f} s  p10-p90 {spread}")
            rows.append({"command": command, "variant": v, "times_s": ts, "median_s": med[v]})
        print(f"{command:8s} fork/exec {med['fork'] / med['exec']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
