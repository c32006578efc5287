"""What the two world-change policies do when a run loses half its workers mid-way.

    python benchmarks/world_change.py [--workload digits] [--seeds 0,1,2] [--epochs 10] [--stop 30]

Per seed: a reference run on 2 workers from start to end; and runs that train on 2 workers up to
step `--stop`, checkpoint, and finish on 1 worker, once with `world_change=keep-global-batch` (same
global batch through 2 accumulation steps: the same optimization) and once with `scale-lr` (each
worker keeps its batch, so the global batch halves, the learning rate halves by the linear rule over
a ramp, and the run takes twice the steps for the rest of the sample budget). Prints, per policy,
the median over seeds of test accuracy, final loss, steps, and the wall time of the part on one
worker, as a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from dpscale.lab.multirank import run_ranks
from dpscale.train.config import TrainConfig
from dpscale.train.trainer import Trainer


def fit(rank: int, world: int, cfg: dict) -> dict:
    return Trainer(TrainConfig.from_flat(**cfg)).fit().to_dict()


def timed(world: int, cfg: dict) -> tuple[dict, float]:
    t0 = time.perf_counter()
    result = run_ranks(fit, world, cfg, timeout_s=600)[0]
    return result, time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="digits")
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--stop", type=int, default=30, help="the step after which one worker is lost")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rescale-warmup-steps", type=int, default=20)
    args = parser.parse_args()
    base = dict(
        workload=args.workload,
        global_batch=args.global_batch,
        epochs=args.epochs,
        progress="none",
        drift_check_every=0,
        rescale_warmup_steps=args.rescale_warmup_steps,
    )
    rows: dict[str, list[tuple[dict, float]]] = {
        "2 workers throughout": [],
        "keep-global-batch": [],
        "scale-lr": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for seed in (int(s) for s in args.seeds.split(",")):
            cfg = {**base, "seed": seed}
            rows["2 workers throughout"].append(timed(2, cfg))
            for policy in ("keep-global-batch", "scale-lr"):
                ckpt = str(Path(tmp) / f"{seed}-{policy}")
                run_ranks(fit, 2, {**cfg, "max_steps": args.stop, "checkpoint_dir": ckpt}, timeout_s=600)
                rest = {**cfg, "checkpoint_dir": ckpt, "resume": True, "world_change": policy}
                rows[policy].append(timed(1, rest))
    med = statistics.median
    print(
        f"{args.workload}, global batch {args.global_batch} on 2 workers, {args.epochs} epochs; one worker "
        f"from step {args.stop} on; medians over seeds {args.seeds}\n"
    )
    print(
        "| run | test accuracy (min-max) | final loss | steps | global batch at the end "
        "| wall s (resumed: the part on 1 worker) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, runs in rows.items():
        acc = [r["test_accuracy"] for r, _ in runs]
        print(
            f"| {name} | {med(acc):.2%} ({min(acc):.2%}-{max(acc):.2%}) | "
            f"{med(r['final_loss'] for r, _ in runs):.4f} | {med(r['steps'] for r, _ in runs):.0f} | "
            f"{runs[0][0]['global_batch']} | {med(s for _, s in runs):.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
