"""dpscale on shm alone vs between other engines: what the local validation's shm row measures.

    python benchmarks/shm_interleaved.py [--model digits] [--steps 1500] [--repeats 2]

The local validation (predict_validation.py local) times dpscale on shm inside the scaling bench,
in rounds of 5 steps between dpscale-gloo, torch DDP and the local engine. A training job runs one
engine without pause. This runs the scaling bench at world size 2 both ways, alternating: `alone`
(engines = dpscale only) and `interleaved` (the validation's four engines), and prints, per run,
the median step time of the slower rank (p10-p90) and the engine's own per-step reduce time
(rank 0). On a loaded 2-core machine the two differ by 2-5x (docs/performance-model.md), so a
prediction calibrated on continuous synchronized steps (predict/sync.py) is checked against the
continuous figure, not the interleaved one.
"""

from __future__ import annotations

import argparse
import os
import statistics

from dpscale.lab.bench import rounds, scaling

VARIANTS = {
    "alone": ["dpscale"],
    "interleaved": ["dpscale", "dpscale-gloo", "torch", "local"],  # predict_validation.py local's
}


def run_once(model: str, batch: int, steps: int, engines: list[str]) -> tuple[list[float], list[float]]:
    """The dpscale (shm) run's per-step time of the slower rank, and its per-step reduce time."""
    config = scaling.ScalingConfig(
        model=model, per_worker_batch=batch, world_sizes=[2], steps=steps, engines=engines
    )
    run = next(r for r in scaling.run(config).runs if r.engine == "dpscale")
    if run.transport != "shm":
        raise SystemExit(f"dpscale ran on {run.transport}, not shm (shm needs x86-64 Linux)")
    return [max(step) for step in run.step_ms], list(run.comm_ms or [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="digits")
    parser.add_argument("--per-worker-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    q = rounds.quantile
    for rep in range(args.repeats):
        for name, engines in VARIANTS.items():
            step, comm = run_once(args.model, args.per_worker_batch, args.steps, engines)
            comm_txt = f"{statistics.median(comm):.2f}" if comm else "-"
            print(
                f"round {rep} {name:11s} step {statistics.median(step):.2f} ms "
                f"(p10 {q(step, 0.1):.2f}, p90 {q(step, 0.9):.2f}); reduce {comm_txt} ms/step; "
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
