"""How much could any schedule of batches gain on a task? The noise scale along a long run at one
fixed batch, and the bound it sets on growing the batch.

    python benchmarks/archive/auto_batch_bound.py [--task digits] [--samples 200000] [--every 100]
                                          [--seed 0] [--json out.json] [--step-ms 1=19.6,...]
    python benchmarks/archive/auto_batch_bound.py --render out.json [--step-ms ...]
    python benchmarks/archive/auto_batch_bound.py --task digits --measure gloo [--rate-gbit 0.1]

Two workers train the task (benchmarks/auto_batch.py's micro-batch, rate and AdaScale gain) at the
smallest global batch 2b, far past the targets auto_batch.py uses, measuring the noise scale
every step and the eval loss every `every` steps. McCandlish et al. (2018): a step at batch B
makes 1 / (1 + B_noise / B) of the progress of a step at an infinite batch, so the measured
noise scale tells how the way to each eval loss splits into stretches of small and of large
noise scale. Along that way, an oracle that knows the noise scale takes the best accumulation k
at every step; the best fixed k takes one for the whole way. Their ratio is the most any growth
rule could gain on this run. Step times are modelled as t(k) = c + k (c: the fixed cost per step,
in micro-batch computes, e.g. the all-reduce over a slow link), for c from 0.25 to 256, k up to
64: the bound over every such machine, since only the ratio c / m of fixed to per-sample cost
matters. The table gives, at each eval: the noise scale (a running median over `--window` steps
of the smoothed estimate; a step whose smoothed |G|^2 is not positive counts as infinite), the
share of the way made (1.00 at the lowest eval loss of the run), and the oracle's ratio to the
best fixed k at the c most favourable to growth (the lowest ratio over the c tried); with
`--step-ms`, also at the line fitted to those step times (one machine).

`--measure TRANSPORT` prints the step times at k = 1..16 on 2 workers (5 rounds, the k taking
turns); with `--rate-gbit` the two workers are two emulated hosts (network namespaces, a token
bucket on each link, benchmarks/predict_lab/netns.py), so the all-reduce crosses a slow link.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# archived: auto_batch.py and predict_lab/ stay in benchmarks/, one folder up
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from auto_batch import TASKS, build_trainer, oracle_times  # noqa: E402
from predict_lab.netns import EmulatedHosts, remove_stale, unavailable  # noqa: E402

from dpscale.lab.bench.weak import TargetWatch
from dpscale.lab.multirank import run_ranks
from dpscale.train.adaptive.adascale import AdaScaleGain
from dpscale.train.config import TrainConfig

FIXED_COSTS = (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256)  # c in micro-batch computes
KS = (1, 2, 4, 8, 16, 32, 64)
MEASURED_KS = [1, 2, 4, 8, 16]
NETNS_PREFIX = "dpsauto"  # this script's network namespaces (removed after each run)
# the token bucket's depth: small, so that a step's all-reduce (100 KB on digits) cannot go out at
# full speed from tokens saved up during the compute, as a deeper bucket (128 KB) let it: a real link
# does not bank its idle time
BURST_KB = 8
ROUNDS = 5  # of the step-time measurement: the k take turns, so the load's drift falls on all alike


def _long_run(
    rank: int, world: int, task: str, samples: int, every: int, seed: int, lr_factor: float = 1.0
) -> dict:
    micro, _, lr, _ = TASKS[task]
    lr *= lr_factor
    base = 2 * micro
    watch = TargetWatch(name="loss", value=-math.inf, every_samples=base * every)  # never met
    with tempfile.TemporaryDirectory() as tmp:
        config = TrainConfig.from_flat(
            workload=task,
            global_batch=base,
            micro_batch=micro,
            lr=lr,
            max_steps=samples // base,
            seed=seed,
            progress="none",
            drift_check_every=0,
            noise_scale_every=1,
            metrics_dir=tmp,
        )
        build_trainer(config, [watch, AdaScaleGain(base_batch=base)]).fit()
        lines = Path(tmp, "metrics.jsonl").read_text().splitlines() if rank == 0 else []
    steps = [json.loads(line) for line in lines]
    return {
        "task": task,
        "seed": seed,
        "lr": lr,
        "global_batch": base,
        "evals": [{"step": c["step"], "samples": c["samples"], "loss": c["value"]} for c in watch.checks],
        "gns": [s.get("gns") for s in steps],
        "step_ms": [s["step_ms"] for s in steps],
    }


def _step_times(
    rank: int, world: int, task: str, transport: str, ks: list[int], steps: int
) -> dict[int, float]:
    """The median training step at global batch 2b x k over `transport`, for each k (the first
    3 steps, which set up buffers and caches, left out); the k take turns over ROUNDS rounds."""
    micro, _, lr, _ = TASKS[task]
    times: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(ROUNDS):
        for k in ks:
            with tempfile.TemporaryDirectory() as tmp:
                config = TrainConfig.from_flat(
                    workload=task,
                    global_batch=2 * micro * k,
                    micro_batch=micro,
                    lr=lr,
                    max_steps=steps + 3,
                    progress="none",
                    drift_check_every=0,
                    transport=transport,
                    metrics_dir=tmp,
                )
                build_trainer(config, []).fit()
                lines = Path(tmp, "metrics.jsonl").read_text().splitlines() if rank == 0 else []
            times[k] += [json.loads(line)["step_ms"] for line in lines[3:]]
    return {k: statistics.median(v) for k, v in times.items()} if rank == 0 else {}


def _measure_over_link(task: str, rate_gbit: float, ks: list[int], steps: int) -> dict[int, float]:
    """`_step_times` on two emulated hosts (network namespaces, benchmarks/predict_lab/netns.py) whose links
    a token bucket caps at `rate_gbit`: the all-reduce crosses a slow link, as between two
    machines, and is the step's fixed cost. Namespaces and processes are removed on exit."""
    if reason := unavailable(NETNS_PREFIX):
        raise SystemExit(f"--rate-gbit needs emulated hosts: {reason}")
    remove_stale(NETNS_PREFIX)
    with (
        tempfile.TemporaryDirectory() as tmp,
        EmulatedHosts(2, prefix=NETNS_PREFIX, rate_gbit=rate_gbit, burst_kb=BURST_KB) as hosts,
    ):
        argv = [sys.executable, __file__, "--task", task, "--link-store", f"{tmp}/store", "--link-rank"]
        procs = []
        for i in range(2):
            # gloo on the link (the host name resolves to 127.0.0.1 here); each its own host
            env = os.environ | {"GLOO_SOCKET_IFNAME": "eth0", "DPSCALE_HOST_ID": f"auto-bound-{i}"}
            procs.append(hosts.start(i, [*argv, str(i)], env=env, stdout=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=1800)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"a host failed (exit codes {[p.returncode for p in procs]})")
    return {int(k): t for k, t in json.loads(outs[0].strip().splitlines()[-1]).items()}


def _link_rank(rank: int, store: str, task: str, ks: list[int], steps: int) -> None:
    """One of `_measure_over_link`'s two processes: a gloo group through a file store (the
    namespaces share the file system), then `_step_times`; rank 0 prints them as JSON."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    dist.barrier()
    try:
        times = _step_times(rank, 2, task, "gloo", ks, steps)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(times))


def running_noise(gns: list[float | None], *, window: int, first: int = 8) -> list[float]:
    """Each step's noise scale: the median over `window` steps either side of the smoothed
    estimates, where None after the first `first` steps (the smoothed |G|^2 not positive: the
    gradient lost in its noise) counts as infinite, and the first steps count not at all."""
    values = [math.inf if g is None or g <= 0 else g for g in gns]
    values[:first] = [math.nan] * min(first, len(values))
    out = []
    for i in range(len(values)):
        near = [v for v in values[max(0, i - window) : i + window + 1] if not math.isnan(v)]
        out.append(statistics.median(near) if near else math.nan)
    out[:first] = [math.nan] * min(first, len(out))  # not filled in from the steps after them
    return out


def shares_of_the_way(noise: list[float], batch: int) -> list[float]:
    """Each step's progress at `batch` samples: 1 / (1 + B_noise / batch) (McCandlish et al.);
    0 where the noise scale is infinite, unknown (nan) steps left out as 0."""
    return [0.0 if math.isnan(n) else 1.0 / (1.0 + n / batch) for n in noise]


def bound(noise: list[float], shares: list[float], *, base: int) -> dict[float, tuple[int, float]]:
    """Per fixed cost c (FIXED_COSTS, step t(k) = c + k): (best fixed k, oracle / best fixed)."""
    kept = [(n, s) for n, s in zip(noise, shares, strict=True) if s > 0]
    if not kept:
        return {}
    out = {}
    for c in FIXED_COSTS:
        fixed, oracle = oracle_times(
            {k: c + k for k in KS}, base=base, noise=[n for n, _ in kept], shares=[s for _, s in kept]
        )
        out[c] = (min(fixed, key=fixed.get), oracle)
    return out


def fit_line(step_ms: dict[int, float]) -> tuple[float, float]:
    """(c, m) of the least-squares line t(k) = c + m k through measured step times. The oracle is
    given the line, not the medians: on a shared host the medians wobble by a few ms, and an
    oracle picks whichever k a wobble made cheap (0.90-1.00 on digits from three measurements of
    one link, 0.94-0.97 from their lines)."""
    if len(step_ms) < 2:
        raise ValueError(f"--step-ms: need step times at two k or more, got {step_ms}")
    ks, ts = list(step_ms), list(step_ms.values())
    k_mean, t_mean = statistics.fmean(ks), statistics.fmean(ts)
    m = sum((k - k_mean) * (t - t_mean) for k, t in zip(ks, ts, strict=True)) / sum(
        (k - k_mean) ** 2 for k in ks
    )
    return t_mean - m * k_mean, m


def render(run: dict, *, window: int, step_ms: dict[int, float] | None = None) -> list[str]:
    """The table; with `step_ms` (ms at each k), a column for the oracle at the line through them
    (fit_line), over the k measured."""
    line = fit_line(step_ms) if step_ms else None
    base = run["global_batch"]
    noise = running_noise(run["gns"], window=window)
    shares = shares_of_the_way(noise, base)
    # the way to the lowest eval loss the run reaches (1.00); past it, no eval target is left
    lowest = min(run["evals"], key=lambda e: e["loss"])["step"] if run["evals"] else len(shares)
    total = sum(shares[:lowest]) or 1.0
    lines = [
        f"{run['task']}, seed {run['seed']}, lr {run.get('lr', '?')}, global batch {base}: median step "
        f"{statistics.median(run['step_ms']):.1f} ms",
        "| step | samples | eval loss | noise scale | way made | oracle / best fixed k at the c most "
        "favourable to growth |"
        + (f" at t(k) = {line[0]:.1f} + {line[1]:.2f} k ms (best fixed k) |" if line else ""),
        "|---:|---:|---:|---:|---:|---:|" + ("---:|" if step_ms else ""),
    ]
    for e in run["evals"]:
        n = e["step"]
        b = bound(noise[:n], shares[:n], base=base)
        c = min(b, key=lambda c: b[c][1]) if b else None
        cell = f"{b[c][1]:.3f} (c = {c}, best fixed k = {b[c][0]})" if c is not None else "-"
        kept = [(x, sh) for x, sh in zip(noise[:n], shares[:n], strict=True) if sh > 0]
        if line and kept:
            fixed, oracle = oracle_times(
                {k: line[0] + line[1] * k for k in step_ms},
                base=base,
                noise=[x for x, _ in kept],
                shares=[sh for _, sh in kept],
            )
            cell += f" | {oracle:.3f} ({min(fixed, key=fixed.get)})"
        elif line:
            cell += " | -"
        lines.append(
            f"| {n} | {e['samples']} | {e['loss']:.4f} | {noise[n - 1]:.0f} | "
            f"{sum(shares[:n]) / total:.2f} | {cell} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="digits", choices=sorted(TASKS))
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--every", type=int, default=100, help="steps between evaluations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr-factor", type=float, default=1.0, help="times auto_batch.py's learning rate")
    parser.add_argument("--window", type=int, default=25, help="steps either side in the running median")
    parser.add_argument("--json")
    parser.add_argument("--render", help="a --json file to render instead of running")
    parser.add_argument(
        "--step-ms", help="K=MS,...: step times at each accumulation k (e.g. from --measure) for a column"
    )
    parser.add_argument(
        "--measure",
        metavar="TRANSPORT",
        help="instead: print the median step time at k = 1..16 on 2 workers over TRANSPORT (gloo, shm)",
    )
    parser.add_argument(
        "--rate-gbit", type=float, help="with --measure gloo: two emulated hosts, links this fast"
    )
    parser.add_argument("--link-rank", type=int, help=argparse.SUPPRESS)  # a --rate-gbit process
    parser.add_argument("--link-store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.link_rank is not None:
        _link_rank(args.link_rank, args.link_store, args.task, MEASURED_KS, 20)
        return
    if args.measure:
        if args.rate_gbit:
            times = _measure_over_link(args.task, args.rate_gbit, MEASURED_KS, 20)
        else:
            times = run_ranks(_step_times, 2, args.task, args.measure, MEASURED_KS, 20, timeout_s=3600)[0]
        print(",".join(f"{k}={t:.2f}" for k, t in times.items()))
        return
    step_ms = None
    if args.step_ms:
        try:
            step_ms = {int(k): float(t) for k, t in (pair.split("=") for pair in args.step_ms.split(","))}
            fit_line(step_ms)
        except ValueError as err:
            parser.error(f"--step-ms: give K=MS,... at two k or more, e.g. 1=19.6,16=36.6 ({err})")
    if args.render:
        run = json.loads(Path(args.render).read_text())
    else:
        run = run_ranks(
            _long_run, 2, args.task, args.samples, args.every, args.seed, args.lr_factor, timeout_s=3600
        )[0]
        if args.json:
            Path(args.json).write_text(json.dumps(run))
    print("\n".join(render(run, window=args.window, step_ms=step_ms)))


if __name__ == "__main__":
    main()
