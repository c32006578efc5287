"""What one `run_ranks` call costs before the rank's own work: the harness's start-up, A vs B.

    python benchmarks/rank_startup.py [--rounds 8] [--calls 3] [--json out.json]

Every multi-rank test pays this once per `run_ranks` call, so it is most of what a short test
costs. A round is a fresh Python process that runs `calls` calls of `run_ranks(step, 2)`, where
`step` builds what nearly every test builds (a small model, an SGD optimizer, one step) and
returns the CPU seconds its process spent since the fork (/proc/self/stat), which a loaded host
does not inflate the way it inflates wall time. The variants differ only in the forkserver's
preload list (multirank.PRELOAD):

- `before`: torch, torch.distributed, dpscale (as until 2026-12-01);
- `after`: the same plus torch._dynamo (what multirank.PRELOAD holds now).

Rounds alternate before/after. The first call of a round also starts the forkserver (once per
test session) and is reported apart. Figures of record: per variant, the median and p10-p90 of
a warm call's wall time and of a rank's CPU seconds, and the after/before ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from dpscale.lab.bench.rounds import quantile

VARIANTS = {
    "before": ("torch", "torch.distributed", "dpscale"),
    "after": ("torch", "torch.distributed", "torch._dynamo", "dpscale"),
}


def process_cpu_s() -> float:
    fields = open(f"/proc/{os.getpid()}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def step(rank: int, world: int) -> float:
    import torch

    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(4, 8)).sum().backward()
    opt.step()
    return process_cpu_s()


def one_round(variant: str, calls: int) -> dict:
    """In a fresh process: `calls` run_ranks calls under the variant's preload list."""
    from dpscale.lab import multirank

    multirank.PRELOAD = VARIANTS[variant]
    walls, cpus = [], []
    for _ in range(calls):
        t0 = time.monotonic()
        cpus += multirank.run_ranks(step, 2)
        walls.append(time.monotonic() - t0)
    return {"walls_s": walls, "rank_cpu_s": cpus}


def summary(values: list[float]) -> dict:
    return {
        "median": statistics.median(values),
        "p10": quantile(values, 0.1),
        "p90": quantile(values, 0.9),
        "n": len(values),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="rounds per variant")
    parser.add_argument("--calls", type=int, default=3, help="run_ranks calls per round")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--round", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.round:  # a child round: report on stdout as JSON
        print(json.dumps(one_round(args.round, args.calls)))
        return
    runs = {v: {"first_s": [], "warm_s": [], "rank_cpu_s": []} for v in VARIANTS}
    for i in range(args.rounds * len(VARIANTS)):
        variant = list(VARIANTS)[i % len(VARIANTS)]
        cmd = [sys.executable, __file__, "--round", variant, "--calls", str(args.calls)]
        out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        runs[variant]["first_s"].append(out["walls_s"][0])
        runs[variant]["warm_s"] += out["walls_s"][1:]
        runs[variant]["rank_cpu_s"] += out["rank_cpu_s"]
    figures = {v: {k: summary(vals) for k, vals in r.items()} for v, r in runs.items()}
    for what in ("first_s", "warm_s", "rank_cpu_s"):
        a, b = (figures[v][what] for v in VARIANTS)
        ratio = b["median"] / a["median"]
        print(
            f"{what:>10}: before {a['median']:.2f} ({a['p10']:.2f}-{a['p90']:.2f})  "
            f"after {b['median']:.2f} ({b['p10']:.2f}-{b['p90']:.2f})  after/before {ratio:.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "calls": args.calls, "figures": figures}, f, indent=1)


if __name__ == "__main__":
    main()
