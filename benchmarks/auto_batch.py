"""`--global-batch auto` against fixed global batches: time to a target on 2 workers.

    python benchmarks/auto_batch.py [--tasks digits,transformer] [--rounds 2] [--json out.json]

Two workers, each with a fixed micro-batch b, train to a target eval loss with the global batch
2b x k for k = 1, 2, 4, 8 (accumulation), and with the batch grown by the noise scale
(train/auto_batch.py: k doubles while the measured noise scale is at least twice the global batch).
Every variant takes AdaScale's learning-rate gain relative to 2b (train/adascale.py), so the rate
follows the batch in all of them alike. Time to target = the sum of the training steps' times
until the target (evaluations excluded); variants take turns in rounds whose order rotates, and
the figure is the median over rounds. The 2-core host is shared: compare within a round's ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from dpscale import Task
from dpscale.bench.weak import TargetWatch
from dpscale.multirank import run_ranks
from dpscale.train.adascale import AdaScaleGain
from dpscale.train.auto_batch import GrowBatch
from dpscale.train.config import TrainConfig
from dpscale.train.trainer import Trainer
from dpscale.workloads import WORKLOADS, datasets, models

# task -> (micro-batch per worker b, target eval loss, learning rate at 2b, sample budget)
TASKS = {
    "digits": (16, 0.25, 0.05, 60_000),
    "transformer": (4, 1.0, 1e-3, 8_000),
}
FIXED = (1, 2, 4, 8)


def _variant(rank: int, task: str, k: int | None) -> dict:
    micro, target, lr, budget = TASKS[task]
    base = 2 * micro
    start = base * (k or 1)
    watch = TargetWatch(name="loss", value=target, every_samples=start)
    callbacks = [watch, AdaScaleGain(base_batch=base)]
    grow = GrowBatch(max_global_batch=base * max(FIXED)) if k is None else None
    if grow is not None:
        callbacks.append(grow)
    with tempfile.TemporaryDirectory() as tmp:
        config = TrainConfig(
            workload=task,
            global_batch=start,
            micro_batch=micro,
            lr=lr,
            max_steps=budget // start,
            seed=0,
            progress="none",
            drift_check_every=0,
            noise_scale_every=1,
            metrics_dir=tmp,
        )
        if task == "transformer":  # no eval set: give it one (the same token rule, other starts)
            work = WORKLOADS["transformer"]
            held_out = datasets.synthetic_tokens(64, 64, seed=1)
            trainer = Trainer(
                config,
                Task(models.transformer, work.task(0).train_data, held_out, loss=work.loss),
                callbacks=callbacks,
            )
        else:
            trainer = Trainer(config, callbacks=callbacks)
        trainer.fit()
        steps = (
            [json.loads(line) for line in Path(tmp, "metrics.jsonl").read_text().splitlines()]
            if rank == 0
            else []
        )
    last = watch.checks[-1] if watch.checks else None
    reached = last is not None and last["value"] <= target
    # evaluation runs at every step whose sample count is a multiple of `every`; its time is in the
    # step's step_ms, so it is taken out
    train_s = sum(s["step_ms"] for s in steps if not reached or s["step"] <= last["step"]) / 1e3
    train_s -= sum(t for step, t in watch.eval_s.items() if not reached or step <= last["step"])
    return {
        "task": task,
        "variant": "auto" if k is None else f"fixed x{k}",
        "reached": reached,
        "steps": last["step"] if reached else None,
        "samples": last["samples"] if reached else None,
        "time_to_target_s": train_s if reached else None,
        "final_global_batch": trainer.state.global_batch,
        "batch_changes": grow.changes if grow else [],
    }


def _all(rank: int, world: int, tasks: list[str], rounds: int) -> list[dict]:
    out = []
    variants: list[int | None] = [*FIXED, None]
    for r in range(rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for task in tasks:
            for k in order:
                out.append(_variant(rank, task, k) | {"round": r})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="digits,transformer")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    tasks = args.tasks.split(",")
    rows = run_ranks(_all, 2, tasks, args.rounds, timeout_s=3600)[0]
    print("| task | variant | reached (rounds) | steps | samples | time to target s (median) | final batch |")
    print("|:---|:---|---:|---:|---:|---:|---:|")
    for task in tasks:
        for variant in [f"fixed x{k}" for k in FIXED] + ["auto"]:
            mine = [r for r in rows if r["task"] == task and r["variant"] == variant]
            times = [r["time_to_target_s"] for r in mine if r["reached"]]
            med = f"{statistics.median(times):.2f}" if times else "not reached"
            steps = "/".join(str(r["steps"]) for r in mine)
            samples = "/".join(str(r["samples"]) for r in mine)
            final = "/".join(str(r["final_global_batch"]) for r in mine)
            print(
                f"| {task} | {variant} | {len(times)}/{len(mine)} | {steps} | {samples} | {med} | {final} |"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
