"""Workers forked from a preloaded server against started afresh, A vs B (train and run).

    flock /tmp/dpscale-bench.lock python benchmarks/worker_start.py [--rounds 6] [--json out.json]
        [--commands short,restart,run,run1-ddp,run2-ddp,run1-torch,run2-torch]

Each round runs two commands per variant, the variants alternating (which goes first rotates):

- `short`: `dpscale train --workload synthetic --nproc 2 --max-steps 5` (start, five steps, end:
  what a short job, a test, or a `scale` point pays to start);
- `restart`: the same with 30 steps, `--max-restarts 1` and rank 1 killed at step 10 of the first
  attempt (dpscale.testing.faults): the agent stops the survivor and starts both workers again;
- `run`: `dpscale run --nproc 2 examples/nanogpt_style.py` for 5 iterations (a user's script,
  launch/script_main.py); the losses it prints are checked equal across variants;
- `run{1,2}-{ddp,torch}`: `dpscale run --nproc 1|2` of the smallest scripts (DDP_SCRIPT: a DDP
  model and three SGD steps; TORCH_SCRIPT: `import torch` only): what the server's preload costs a
  script that needs less than `train` does.

Variants (launch/fork_start.py, DPSCALE_WORKER_START): `fork` (the default: the command starts
multiprocessing's forkserver before it imports torch; the agent forks each worker from it) and
`exec` (each worker is `python -m dpscale.launch.worker`, importing torch itself). Figures of
record: per command and variant the median wall time over rounds with p10-p90, and the fork/exec
ratio of the medians, and the same for CPU seconds (the command's and all it started). The
parameters each run ends with are checked equal across variants.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from dpscale.lab.bench.rounds import quantile

TRAIN = ["train", "--workload", "synthetic", "--nproc", "2", "--json", "--progress", "none"]
EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
# name: (the command's arguments, its faults); {tmp} is a fresh directory per run
COMMANDS = {
    "short": ([*TRAIN, "--max-steps", "5", "--checkpoint-dir", "{tmp}/ck", "--checkpoint-every", "5"], None),
    "restart": (
        [
            *TRAIN,
            "--max-steps",
            "30",
            "--max-restarts",
            "1",
            "--checkpoint-dir",
            "{tmp}/ck",
            "--checkpoint-every",
            "5",
        ],
        "kill@step=10,rank=1,attempt=0",
    ),
    # a user's script (launch/script_main.py): nanoGPT's style, 5 iterations, its losses compared
    "run": (
        [
            "run",
            "--nproc",
            "2",
            os.path.join(EXAMPLES, "nanogpt_style.py"),
            "--max_iters=5",
            "--eval_interval=1000",
            "--log_interval=1",
        ],
        None,
    ),
}
# the smallest scripts a user runs: a DDP model and a few SGD steps (dpscale's engine stands in for
# DDP), and one that imports only torch; at one worker and at two, {tmp}/s.py written per run
DDP_SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    model(torch.ones(8, 16)).pow(2).sum().backward()
    opt.step()
if dist.get_rank() == 0:
    print("loss", round(float(model(torch.ones(8, 16)).pow(2).sum()), 4))
dist.destroy_process_group()
"""
TORCH_SCRIPT = """
import os, torch
if os.environ["RANK"] == "0":
    print("loss", torch.ones(2).sum().item())
"""
SCRIPTS = {"ddp": DDP_SCRIPT, "torch": TORCH_SCRIPT}
for _name in SCRIPTS:
    for _n in (1, 2):
        COMMANDS[f"run{_n}-{_name}"] = (["run", "--nproc", str(_n), "{tmp}/s.py"], None)
VARIANTS = ("fork", "exec")


def run(variant: str, command: str) -> tuple[float, float, str]:
    """One command: its wall and CPU seconds (the command and all it started), and what it ended
    with (train's parameters' digest; the script's printed losses)."""
    flags, faults = COMMANDS[command]
    env = dict(os.environ, DPSCALE_WORKER_START=variant)
    if faults:
        env.update(DPSCALE_FAULTS=faults, DPSCALE_CALLBACKS="dpscale.testing.faults:FaultInjector")
    with tempfile.TemporaryDirectory() as tmp:
        if command.startswith("run") and "-" in command:
            with open(os.path.join(tmp, "s.py"), "w") as f:
                f.write(SCRIPTS[command.split("-")[1]])
        cmd = [sys.executable, "-m", "dpscale.cli.main", *(a.format(tmp=tmp) for a in flags)]
        cpu = _children_cpu_s()
        start = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp)
        wall = time.monotonic() - start
        cpu = _children_cpu_s() - cpu
    if p.returncode != 0:
        raise SystemExit(f"{variant} {command} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    if command.startswith("run"):
        return (
            wall,
            cpu,
            " ".join(line.split(", time")[0] for line in p.stdout.splitlines() if "loss" in line),
        )
    return wall, cpu, json.loads(p.stdout.strip().splitlines()[-1])["param_sha256"]


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of the waited-for children so far, theirs included: a figure a
    loaded host distorts less than wall time. A forked worker's parent is the command's server, a
    child of the command, so the command's figure holds its workers' either way."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--commands", default=",".join(COMMANDS), help=f"some of {','.join(COMMANDS)}")
    args = parser.parse_args()
    commands = args.commands.split(",")
    if unknown := set(commands) - set(COMMANDS):
        parser.error(f"--commands: unknown {', '.join(sorted(unknown))}; choose from {','.join(COMMANDS)}")
    times: dict[tuple[str, str], list[tuple[float, float]]] = {(v, c): [] for v in VARIANTS for c in commands}
    ends: dict[str, set[str]] = {c: set() for c in commands}
    for r in range(args.rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for command in commands:
            for variant in order:
                wall, cpu, end = run(variant, command)
                times[variant, command].append((wall, cpu))
                ends[command].add(end)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    rows = [_row(command, times, ends[command]) for command in commands]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "rows": [r for pair in rows for r in pair]}, f, indent=1)


def _row(command: str, times: dict, ends: set[str]) -> list[dict]:
    assert len(ends) == 1, f"{command}: the variants ended differently: {ends}"
    med = {v: statistics.median(w for w, _ in times[v, command]) for v in VARIANTS}
    cpu = {v: statistics.median(c for _, c in times[v, command]) for v in VARIANTS}
    rows = []
    for v in VARIANTS:
        ts = [w for w, _ in times[v, command]]
        spread = f"{quantile(ts, 0.1):.2f}-{quantile(ts, 0.9):.2f}"
        print(f"{command:8s} {v:5s} median {med[v]:6.2f} s  p10-p90 {spread}  cpu {cpu[v]:6.2f} s")
        rows.append(
            {"command": command, "variant": v, "times_s": ts, "median_s": med[v], "cpu_median_s": cpu[v]}
        )
    print(f"{command:8s} fork/exec {med['fork'] / med['exec']:.2f} (cpu {cpu['fork'] / cpu['exec']:.2f})")
    return rows


if __name__ == "__main__":
    main()
