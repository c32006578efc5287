"""How much could any schedule of batches gain on a task? The noise scale along a long run at one
fixed batch, and the bound it sets on growing the batch.

    python benchmarks/auto_batch_bound.py [--task digits] [--samples 200000] [--every 100]
                                          [--seed 0] [--json out.json]

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
best fixed k at the c most favourable to growth (the lowest ratio over the c tried).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path

from auto_batch import TASKS, build_trainer, oracle_times

from dpscale.bench.weak import TargetWatch
from dpscale.multirank import run_ranks
from dpscale.train.adascale import AdaScaleGain
from dpscale.train.config import TrainConfig

FIXED_COSTS = (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256)  # c in micro-batch computes
KS = (1, 2, 4, 8, 16, 32, 64)


def _long_run(rank: int, world: int, task: str, samples: int, every: int, seed: int) -> dict:
    micro, _, lr, _ = TASKS[task]
    base = 2 * micro
    watch = TargetWatch(name="loss", value=-math.inf, every_samples=base * every)  # never met
    with tempfile.TemporaryDirectory() as tmp:
        config = TrainConfig(
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
        "global_batch": base,
        "evals": [{"step": c["step"], "samples": c["samples"], "loss": c["value"]} for c in watch.checks],
        "gns": [s.get("gns") for s in steps],
        "step_ms": [s["step_ms"] for s in steps],
    }


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


def render(run: dict, *, window: int) -> list[str]:
    base = run["global_batch"]
    noise = running_noise(run["gns"], window=window)
    shares = shares_of_the_way(noise, base)
    # the way to the lowest eval loss the run reaches (1.00); past it, no eval target is left
    lowest = min(run["evals"], key=lambda e: e["loss"])["step"] if run["evals"] else len(shares)
    total = sum(shares[:lowest]) or 1.0
    lines = [
        f"{run['task']}, seed {run['seed']}, global batch {base}: median step "
        f"{statistics.median(run['step_ms']):.1f} ms",
        "| step | samples | eval loss | noise scale | way made | oracle / best fixed k at the c most "
        "favourable to growth |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for e in run["evals"]:
        n = e["step"]
        b = bound(noise[:n], shares[:n], base=base)
        c = min(b, key=lambda c: b[c][1]) if b else None
        cell = f"{b[c][1]:.3f} (c = {c}, best fixed k = {b[c][0]})" if c is not None else "-"
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
    parser.add_argument("--window", type=int, default=25, help="steps either side in the running median")
    parser.add_argument("--json")
    parser.add_argument("--render", help="a --json file to render instead of running")
    args = parser.parse_args()
    if args.render:
        run = json.loads(Path(args.render).read_text())
    else:
        run = run_ranks(_long_run, 2, args.task, args.samples, args.every, args.seed, timeout_s=3600)[0]
        if args.json:
            Path(args.json).write_text(json.dumps(run))
    print("\n".join(render(run, window=args.window)))


if __name__ == "__main__":
    main()
