"""`--global-batch auto` against fixed global batches: time to a target on 2 workers.

    python benchmarks/auto_batch.py [--tasks digits,transformer] [--rounds 8] [--first-seed 0]
                                     [--json out.json]

Two workers, each with a fixed micro-batch b, train to a target eval loss with the global batch
2b x k for k = 1, 2, 4, 8 (accumulation), and with the batch grown by train/adaptive/auto_batch.GrowBatch:
`auto` (the default rule: double once the noise scale has reached twice the batch and the step
times measured so far do not predict the doubled batch slower to the target; halve back when they
predict the smaller one 10% sooner), `auto (grow at 1x)` and `auto (grow at 0.5x)` (the noise
scale need only reach the batch, or half of it, before the step times decide). Every variant takes
AdaScale's learning-rate gain
relative to 2b (train/adaptive/adascale.py), so the rate follows the batch in all of them alike, and is
evaluated at the same sample counts. Two times to target: the sum of the training steps' measured
times until the target (evaluations excluded), median over rounds; and steps x the median step
time at each step's k over every variant's steps in this run, which takes the host's drift
between variants out (step counts are exact; the 2-core host is shared). Variants take turns in
rounds whose order rotates; round r trains with seed first_seed + r (initial weights and data
order). The seed moves the steps to target more than the batch does, so each variant's time is
also divided by the best fixed batch's time with the same seed: the median of those ratios, with
p10-p90, is the comparison (best fixed: the lowest median time over seeds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from dpscale import Task
from dpscale.lab.bench.rounds import quantile
from dpscale.lab.bench.weak import TargetWatch
from dpscale.lab.multirank import run_ranks
from dpscale.train.adaptive.adascale import AdaScaleGain
from dpscale.train.adaptive.auto_batch import GrowBatch
from dpscale.train.config import TrainConfig
from dpscale.train.trainer import Trainer
from dpscale.workloads import WORKLOADS, datasets, models

# task -> (micro-batch per worker b, target eval loss, learning rate at 2b, sample budget)
TASKS = {
    "digits": (16, 0.25, 0.05, 60_000),
    "transformer": (4, 1.0, 1e-3, 8_000),
}
FIXED = (1, 2, 4, 8)
# auto variants: name -> GrowBatch's grow_at (double once the noise scale is grow_at x the batch)
AUTO = {"auto": 2.0, "auto (grow at 1x)": 1.0, "auto (grow at 0.5x)": 0.5}


def build_trainer(config: TrainConfig, callbacks: list) -> Trainer:
    """The task's Trainer; the transformer workload has no eval set, so it gets one here (the same
    token rule, other starts)."""
    if config.workload != "transformer":
        return Trainer(config, callbacks=callbacks)
    work = WORKLOADS["transformer"]
    held_out = datasets.synthetic_tokens(64, 64, seed=1)
    task = Task(models.transformer, work.task(0).train_data, held_out, loss=work.loss)
    return Trainer(config, task, callbacks=callbacks)


def _variant(rank: int, task: str, k: int | str, seed: int) -> dict:
    micro, target, lr, budget = TASKS[task]
    base = 2 * micro
    start = base * (k if isinstance(k, int) else 1)
    watch = TargetWatch(name="loss", value=target, every_samples=base)
    callbacks = [watch, AdaScaleGain(base_batch=base)]
    grow = None if isinstance(k, int) else GrowBatch(max_global_batch=base * max(FIXED), grow_at=AUTO[k])
    if grow is not None:
        callbacks.append(grow)
    with tempfile.TemporaryDirectory() as tmp:
        config = TrainConfig.from_flat(
            workload=task,
            global_batch=start,
            micro_batch=micro,
            lr=lr,
            max_steps=budget // start,
            seed=seed,
            progress="none",
            drift_check_every=0,
            noise_scale_every=1,
            metrics_dir=tmp,
        )
        trainer = build_trainer(config, callbacks)
        trainer.fit()
        steps = (
            [json.loads(line) for line in Path(tmp, "metrics.jsonl").read_text().splitlines()]
            if rank == 0
            else []
        )
    last = watch.checks[-1] if watch.checks else None
    reached = last is not None and last["value"] <= target
    # evaluation runs after every step whose sample count is a multiple of the smallest global
    # batch, so every variant is judged at the same sample counts; its time is in the step's
    # step_ms, so it is taken out
    ms = [s["step_ms"] - 1e3 * watch.eval_s.get(s["step"], 0.0) for s in steps]
    ks, k_now = [], start // base  # the accumulation factor in force at each step
    changes = dict(grow.changes) if grow else {}
    for s in steps:
        ks.append(k_now)
        if s["step"] in changes:
            k_now = changes[s["step"]] // base
    n = last["step"] if reached else len(steps)
    return {
        "task": task,
        "variant": k if isinstance(k, str) else f"fixed x{k}",
        "reached": reached,
        "steps": last["step"] if reached else None,
        "samples": last["samples"] if reached else None,
        "time_to_target_s": sum(ms[:n]) / 1e3 if reached else None,
        "final_global_batch": trainer.state.global_batch,
        "batch_changes": grow.changes if grow else [],
        "step_k": ks[:n],
        "step_ms": ms[:n],
        "gns": [s.get("gns") for s in steps[:n]],
    }


def _all(rank: int, world: int, tasks: list[str], rounds: int, first_seed: int) -> list[dict]:
    out = []
    variants: list[int | str] = [*FIXED, *AUTO]
    for r in range(rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for task in tasks:
            for k in order:
                out.append(_variant(rank, task, k, seed=first_seed + r) | {"round": r})
    return out


def per_k_step_ms(rows: list[dict]) -> dict[int, float]:
    """The median training step (evaluation excluded) at each accumulation factor k, over every
    variant's steps in this run: a step's time depends on its k, not on the variant that took it,
    so "steps x step time" compares variants without the load's drift between their runs."""
    by_k: dict[int, list[float]] = {}
    for r in rows:
        for k, ms in zip(r["step_k"], r["step_ms"], strict=True):
            by_k.setdefault(k, []).append(ms)
    return {k: round(statistics.median(v), 2) for k, v in sorted(by_k.items())}


def ratios_to_best_fixed(times: dict[str, dict[int, float]]) -> tuple[str | None, dict[str, list[float]]]:
    """The fixed variant with the lowest median time over seeds, and each variant's time divided
    by that variant's time with the same seed (seeds where either missed the target are left out);
    (None, no ratios) when no fixed batch reached the target."""
    fixed = [v for v in times if v.startswith("fixed") and times[v]]
    if not fixed:
        return None, {v: [] for v in times}
    best = min(fixed, key=lambda v: statistics.median(times[v].values()))
    ratios = {
        v: [t / times[best][seed] for seed, t in sorted(by_seed.items()) if seed in times[best]]
        for v, by_seed in times.items()
    }
    return best, ratios


def oracle_times(
    step_ms: dict[int, float], *, base: int, noise: list[float], shares: list[float] | None = None
) -> tuple[dict[int, float], float]:
    """Time to target at each fixed k, and with the k chosen afresh at every point of the run by
    an oracle that knows the noise scale, relative to the best fixed k (up to S_min).

    McCandlish et al.: a step at batch B makes 1 / (1 + B_noise / B) of the progress of a step at
    an infinite batch, so a stretch dp of the run costs (1 + B_noise / B) t(B) dp in time.
    `noise[i]` is the noise scale (samples) over the i-th stretch of the way, `shares[i]` that
    stretch's length (default: equal stretches). The oracle's ratio is the most any growth rule
    could gain with these step times."""
    shares = shares if shares is not None else [1.0] * len(noise)
    cost = {
        k: [s * (1 + n / (base * k)) * t for n, s in zip(noise, shares, strict=True)]
        for k, t in step_ms.items()
    }
    fixed = {k: sum(c) for k, c in cost.items()}
    best = min(fixed.values())
    oracle = sum(min(c[i] for c in cost.values()) for i in range(len(noise)))
    return {k: t / best for k, t in fixed.items()}, oracle / best


def linear_noise(start: float, end: float, points: int = 1000) -> list[float]:
    """A noise scale growing linearly with the way made, from `start` to `end`, at `points` equal
    stretches (for oracle_times)."""
    return [start + (end - start) * (i + 0.5) / points for i in range(points)]


def _noise_range(rows: list[dict], min_updates: int = 8) -> tuple[float, float] | None:
    """The fixed batches' noise scale once `min_updates` steps are in the EMA, and at the target
    (medians over the runs): its growth during the run. None without a fixed run that reached the
    target with that many measured steps."""
    runs = [r["gns"] for r in rows if r["variant"].startswith("fixed") and r["reached"]]
    runs = [g for g in runs if len(g) >= min_updates and None not in (g[min_updates - 1], g[-1])]
    if not runs:
        return None
    return statistics.median(g[min_updates - 1] for g in runs), statistics.median(g[-1] for g in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="digits,transformer")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()
    tasks = args.tasks.split(",")
    rows = run_ranks(_all, 2, tasks, args.rounds, args.first_seed, timeout_s=3600)[0]
    if args.json:  # first: what follows only renders, and a run of up to an hour must not be lost
        Path(args.json).write_text(json.dumps(rows, indent=2))
    print(
        "| task | variant | reached | steps | time to target s: measured, median | steps x step time "
        "of their k, median over seeds | that / best fixed's, same seed: median (p10-p90) | final batch |"
    )
    print("|:---|:---|---:|---:|---:|---:|---:|---:|")
    names = [f"fixed x{k}" for k in FIXED] + list(AUTO)
    for task in tasks:
        step_ms = per_k_step_ms([r for r in rows if r["task"] == task])
        print(f"step time by k, {task} (median over every variant's steps, ms): {step_ms}")
        mine = {v: [r for r in rows if r["task"] == task and r["variant"] == v] for v in names}
        modeled = {
            v: {r["round"]: sum(step_ms[k] for k in r["step_k"]) / 1e3 for r in rs if r["reached"]}
            for v, rs in mine.items()
        }
        best, ratios = ratios_to_best_fixed(modeled)
        for v, rs in mine.items():
            times = [r["time_to_target_s"] for r in rs if r["reached"]]
            med = f"{statistics.median(times):.2f}" if times else "not reached"
            mod = f"{statistics.median(modeled[v].values()):.3f}" if modeled[v] else "not reached"
            q = ratios[v]
            ratio = (
                f"{statistics.median(q):.3f} ({quantile(q, 0.1):.2f}-{quantile(q, 0.9):.2f})" if q else "-"
            )
            ratio += " (best fixed)" if v == best else ""
            steps = "/".join(str(r["steps"]) for r in rs)
            final = "/".join(str(r["final_global_batch"]) for r in rs)
            print(f"| {task} | {v} | {len(times)}/{len(rs)} | {steps} | {med} | {mod} | {ratio} | {final} |")
        noise = _noise_range([r for r in rows if r["task"] == task])
        if noise is None:
            print(f"{task}: no fixed batch reached the target with 8 measured steps: no oracle bound")
            continue
        start, end = noise
        for scale in (1, 3):  # as measured, and 3x (the validation's fitted B_noise is 1.7-3x it)
            noise = linear_noise(scale * start, scale * end)
            fixed, oracle = oracle_times(step_ms, base=2 * TASKS[task][0], noise=noise)
            print(
                f"{task}: noise scale {scale * start:.1f} -> {scale * end:.1f} samples; model times / best "
                f"fixed: {', '.join(f'k={k} {t:.3f}' for k, t in fixed.items())}; oracle growth {oracle:.3f}"
            )


if __name__ == "__main__":
    main()
