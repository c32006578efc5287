"""The shm transport before and after a change, in alternating rounds in one run.

    flock /tmp/dpscale-bench.lock python benchmarks/shm_ab.py [--sizes 4K,16M] [--rounds 30]
        [--workload mlp] [--busy 0] [--world 2] [--small-max-bytes N] [--old-rev db06f5d] [--json out.json]

`--world` ranks (2 by default) hold three shm transports side by side, each with its own
segments, and all-reduce a float32 buffer of each size (in the transport's segments, as the
engine's buckets are) through them in turn, a round of calls each, the order rotating every round
(bench/rounds.py):

- `old`: `src/dpscale/comm/shm.py` as of `--old-rev` (read with `git show`; db06f5d is main before
  the small-message path and the blocking wait: views looked up and a torch Future made on
  every call, spin-then-yield waiting), with `shm_wait.py`, `base.py` and `shm_small.py` of the
  same revision where it has them;
- `spin`: today's transport with `wait="spin"` (the old waiting, the new per-call path);
- `block`: today's transport with `wait="block"` (spin briefly, then sleep on a futex);
- `inplace`: `block` with the one-round path off (every size in place, two barriers).

`spin` and `block` send tensors up to `--small-max-bytes` (default: as shipped,
`shm_small.NATIVE_SMALL_MAX_BYTES` where the C helper builds, else `SMALL_MAX_BYTES`) through the
one-round path (in C where the helper builds, see
comm/shm_native.py; `DPSCALE_SHM_NATIVE=0` runs it in Python), larger ones in place; `old` has
whatever its revision has, with the same limit where it has a one-round path (an `--old-rev` from
before the C helper, e.g. a568b25, is the Python one-round path). To find where the one-round
path stops paying, give it a large limit and compare `block` with `inplace` size by size
(e.g. `--small-max-bytes 131072 --sizes 4K,8K,16K,32K,64K,128K`): the limit is the largest size
at which `block` is still faster.

With `--workload NAME` the ranks instead train that workload (dpscale's engine over each
transport, 64 samples per rank, one intra-op thread, SGD) in rounds of `--steps` steps: what a
training job sees, where the ranks reach each bucket's all-reduce at different moments.

A call's (a step's) time is the slower rank's (the next collective waits for it); a round's figure is the
median over its calls. Printed per size and variant: the median over rounds with p10-p90, the
median of the per-round ratio to `old` with p10-p90, and CPU microseconds per call (both ranks'
process time: what the waiting costs the other processes on the host). `--busy N` starts N
busy-looping processes for the length of the run (the high-load case; the load average is
printed before and after either way).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from dpscale import DistributedDataParallel
from dpscale.comm import SharedMemoryTransport, shm_native, shm_small
from dpscale.lab.bench.args import parse_size_list
from dpscale.lab.bench.rounds import quantile, run_rounds
from dpscale.lab.multirank import run_ranks
from dpscale.workloads import WORKLOADS

VARIANTS = ("old", "spin", "block", "inplace")
REPO = Path(__file__).resolve().parent.parent


def _load(name: str, source: str, rev: str, path: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__package__ = "dpscale.comm"
    sys.modules[name] = module
    exec(compile(source, f"{rev}:{path}", "exec"), module.__dict__)
    return module


# The modules of the transport that `old` takes from `--old-rev` where it has them, in an order
# in which each imports only those before it: the whole transport as of then, not today's
# helpers under an old shm.py
OLD_MODULES = ("shm_wait", "base", "shm_small")


def _old_module(sources: dict[str, str], rev: str) -> types.ModuleType:
    """shm.py as of `rev`, loaded as a module of dpscale.comm, its imports of OLD_MODULES given
    those of `rev` where it has them (the others resolve to today's)."""
    current = {name: sys.modules[f"dpscale.comm.{name}"] for name in OLD_MODULES}
    try:
        for name in OLD_MODULES:
            if name in sources:
                path = f"src/dpscale/comm/{name}.py"
                sys.modules[f"dpscale.comm.{name}"] = _load(
                    f"dpscale.comm._{name}_{rev}", sources[name], rev, path
                )
        return _load(f"dpscale.comm._shm_{rev}", sources["shm"], rev, "src/dpscale/comm/shm.py")
    finally:
        for name, module in current.items():
            sys.modules[f"dpscale.comm.{name}"] = module


def _calls_per_round(nbytes: int) -> int:
    # ~5-20 ms a round on an idle host: long enough to time, short enough for many rounds
    return max(4, min(200, (8 << 20) // max(nbytes, 1)))


def _transports(spec: dict) -> dict:
    """The variants' transports; `spec`: the old sources and revision, the one-round path's limit."""
    old_cls = _old_module(spec["sources"], spec["rev"]).SharedMemoryTransport
    shm_small.SMALL_MAX_BYTES = 0  # read by the transports made below
    inplace = SharedMemoryTransport(timeout_s=120, wait="block")
    # one limit for both one-round paths (C and Python), so a run tests the path in use
    shm_small.SMALL_MAX_BYTES = shm_small.NATIVE_SMALL_MAX_BYTES = spec["small_max_bytes"]
    return {
        "old": old_cls(timeout_s=120),
        "spin": SharedMemoryTransport(timeout_s=120, wait="spin"),
        "block": SharedMemoryTransport(timeout_s=120, wait="block"),
        "inplace": inplace,
    }


def _timed(fn, calls: int) -> tuple[list[float], float]:
    """Per-call seconds of `calls` calls, and the process's CPU seconds for all of them."""
    fn()  # the first call of a round absorbs the ranks' skew
    cpu0 = time.process_time()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times, time.process_time() - cpu0


def _rank_allreduce(rank: int, world: int, spec: dict, sizes: list[int], rounds: int) -> dict:
    transports = _transports(spec)
    out: dict = {}
    for nbytes in sizes:
        bufs = {v: t.alloc(nbytes // 4, torch.float32) for v, t in transports.items()}
        calls = _calls_per_round(nbytes)

        def step(v: str, bufs=bufs, calls=calls) -> tuple[list[float], float]:
            t, buf = transports[v], bufs[v]
            return _timed(lambda: t.all_reduce(buf).wait(), calls)

        out[_size_text(nbytes)] = run_rounds(VARIANTS, step, [1] * rounds)
    for t in transports.values():
        t.close()
    return out


def _rank_engine(rank: int, world: int, spec: dict, name: str, rounds: int, steps: int) -> dict:
    transports = _transports(spec)
    work = WORKLOADS[name]
    train, _ = work.build_data(0)
    models, opts = {}, {}
    for v, t in transports.items():
        torch.manual_seed(0)
        models[v] = DistributedDataParallel(work.build_model(), transport=t, gradient_as_bucket_view=True)
        opts[v] = torch.optim.SGD(models[v].parameters(), lr=work.lr)
    g = torch.Generator().manual_seed(rank)

    def train_step(v: str) -> None:
        idx = torch.randint(0, len(train), (64,), generator=g)
        opts[v].zero_grad(set_to_none=True)
        work.loss(models[v](train.x[idx]), train.y[idx]).mean().backward()
        opts[v].step()

    out = {f"{name} step": run_rounds(VARIANTS, lambda v: _timed(lambda: train_step(v), steps), [1] * rounds)}
    for m in models.values():
        m.close()
    return out


def _figures(per_rank: list[dict], item: str, variant: str) -> tuple[list[float], list[float]]:
    """Per round: the median call time of the slower rank (us), and CPU us per call (all ranks)."""
    rounds = len(per_rank[0][item][variant])
    med, cpu = [], []
    for r in range(rounds):
        timed = [rank[item][variant][r][0] for rank in per_rank]
        calls = len(timed[0][0])
        slowest = [max(t[0][i] for t in timed) for i in range(calls)]
        med.append(statistics.median(slowest) * 1e6)
        cpu.append(sum(t[1] for t in timed) / calls * 1e6)
    return med, cpu


def _busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _size_text(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def _git_show(rev: str, module: str) -> str | None:
    """src/dpscale/comm/MODULE.py as of `rev`, or None if it has none."""
    done = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{rev}:src/dpscale/comm/{module}.py"],
        capture_output=True,
        text=True,
    )
    return done.stdout if done.returncode == 0 else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4K,16M", help="comma-separated, binary K/M (default 4K,16M)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), help="train this instead of all-reducing")
    parser.add_argument("--steps", type=int, default=10, help="steps per round with --workload")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--busy", type=int, default=0, help="busy-looping processes to run meanwhile")
    parser.add_argument("--world", type=int, default=2, help="ranks (more than the cores: oversubscribed)")
    parser.add_argument(
        "--small-max-bytes",
        type=int,
        help="spin/block: largest tensor of the one-round path (default: as shipped; 0 turns it off)",
    )
    parser.add_argument("--old-rev", default="db06f5d", help="git revision of the `old` shm.py")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    sizes = [max(4, s // 4 * 4) for s in parse_size_list(args.sizes, flag="--sizes")]
    if args.rounds < 3 or args.busy < 0 or args.steps < 1 or args.world < 2:
        parser.error("--rounds must be >= 3, --steps >= 1, --busy >= 0 and --world >= 2")
    if args.small_max_bytes is not None and args.small_max_bytes < 0:
        parser.error(f"--small-max-bytes must be >= 0, got {args.small_max_bytes}")
    shipped = shm_small.NATIVE_SMALL_MAX_BYTES if shm_native.library() else shm_small.SMALL_MAX_BYTES
    small_max = shipped if args.small_max_bytes is None else args.small_max_bytes
    old_sources = {name: _git_show(args.old_rev, name) for name in ("shm", *OLD_MODULES)}
    old_sources = {name: text for name, text in old_sources.items() if text is not None}
    if "shm" not in old_sources:
        parser.error(
            f"--old-rev {args.old_rev}: no src/dpscale/comm/shm.py there (a git revision of this repo)"
        )
    if args.workload:
        fn, what = _rank_engine, (args.workload, args.rounds, args.steps)
        items = {f"{args.workload} step": None}
    else:
        fn, what = _rank_allreduce, (sizes, args.rounds)
        items = {_size_text(n): n for n in sizes}
    load_before = os.getloadavg()[0]
    busy = _busy(args.busy)
    try:
        start = time.time()
        spec = {"sources": old_sources, "rev": args.old_rev, "small_max_bytes": small_max}
        per_rank = run_ranks(fn, args.world, spec, *what, timeout_s=1800)
        wall_s = time.time() - start
        load_after = os.getloadavg()[0]
    finally:
        for p in busy:
            p.kill()
            p.wait()
    print(
        f"shm A/B, {args.world} ranks on {os.cpu_count()} CPUs, {args.rounds} rounds, "
        f"{args.busy} busy processes, old = {args.old_rev}, one-round path up to {small_max} B; "
        f"load {load_before:.1f} before, {load_after:.1f} after; {wall_s:.0f} s"
    )
    header = ("what", "variant", "median us (p10-p90)", "/ old (p10-p90)", "CPU us/call")
    print("{:>10} {:>7} {:>28} {:>20} {:>12}".format(*header))
    rows = []
    for item, nbytes in items.items():
        old_med, _ = _figures(per_rank, item, "old")
        for v in VARIANTS:
            med, cpu = _figures(per_rank, item, v)
            ratios = [m / o for m, o in zip(med, old_med, strict=True)]
            row = {
                "what": item,
                "variant": v,
                "median_us": statistics.median(med),
                "p10_us": quantile(med, 0.1),
                "p90_us": quantile(med, 0.9),
                "ratio_to_old": statistics.median(ratios),
                "ratio_p10": quantile(ratios, 0.1),
                "ratio_p90": quantile(ratios, 0.9),
                "cpu_us_per_call": statistics.median(cpu),
            }
            bw = ""
            if nbytes is not None and nbytes >= 1 << 20:
                row["busbw_GBps"] = nbytes / (row["median_us"] * 1e-6) / 1e9
                bw = f"   {row['busbw_GBps']:.2f} GB/s"
            rows.append(row)
            print(
                f"{item:>10} {v:>7} "
                f"{row['median_us']:>11.1f} ({row['p10_us']:.1f}-{row['p90_us']:.1f}) "
                f"{row['ratio_to_old']:>8.2f}x ({row['ratio_p10']:.2f}-{row['ratio_p90']:.2f}) "
                f"{row['cpu_us_per_call']:>10.0f}{bw}"
            )
    if args.json:
        meta = {
            "rounds": args.rounds,
            "workload": args.workload,
            "steps": args.steps,
            "busy": args.busy,
            "world": args.world,
            "small_max_bytes": small_max,
            "old_rev": args.old_rev,
            "load_before": load_before,
            "load_after": load_after,
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        }
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
