"""What measuring the gradient noise scale costs: the mlp workload at 2 workers, off and on.

    python benchmarks/noise_scale_cost.py [--rounds 10] [--steps 8] [--json out.json]

Both ranks train the `mlp` workload (its default global batch, 64 per worker, SGD) with one
dpscale engine, in rounds of `--steps` steps that rotate over five variants (each round pair is
in one run, the order shifts every round):

- `off`: no measurement;
- `every 1`, `every 8`: the training loop's way (dpscale's Trainer): the engine takes each
  rank's local squared norm, per large tensor in the hook right after its copy-and-divide and per
  small bucket at launch, and the loop pairs it with the norm of the reduced gradients it takes
  anyway for its skip check (`NoiseScaleObserver(reduced_norm=False)`);
- `every 1, engine both`: a bare engine under a user's loop, which takes the whole local norm and
  reads the reduced buckets again after the wait (the engine's defaults).

Every variant's loop takes that skip-check norm (torch.nn.utils.get_total_norm), as the Trainer
does, so it is not counted as the measurement's cost. A step is zero_grad + forward + loss +
backward + the norm + optimizer step, one intra-op thread per worker. The figure of record is the
median over rounds of (variant / off) per-step time, with its 10th-90th percentiles. The run also
times the engine's norms themselves inside the measured rounds (a wrapper around `bucket_sq_norm`
where the reducer calls it): their share of the step is the direct, steadier figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from dpscale import DistributedDataParallel
from dpscale.engine import reducer as reducer_module
from dpscale.engine.noise_scale import NoiseScaleEstimator, NoiseScaleObserver
from dpscale.lab.multirank import run_ranks
from dpscale.workloads import WORKLOADS

# name: (measure, every, engine takes the reduced norm too)
VARIANTS = {
    "off": (False, 1, False),
    "every 1": (True, 1, False),
    "every 8": (True, 8, False),
    "every 1, engine both": (True, 1, True),
}


@dataclass
class VariantCost:
    variant: str
    step_ms: float  # median over rounds of the mean step, rank 0
    ratio_median: float | None  # this variant / off in the same round cycle, rank 0
    ratio_p10: float | None
    ratio_p90: float | None
    norm_share_median: float  # time inside the engine's norms / step time, per round, rank 0
    norm_share_p90: float


@dataclass
class NoiseScaleCost:
    workers: int
    per_worker_batch: int
    rounds: int
    steps_per_round: int
    variants: list[VariantCost]
    gns_per_worker_batches: float | None  # the engine's figure at the end, as a sanity check


def _rank(rank: int, world: int, rounds: int, steps: int) -> dict:
    torch.set_num_threads(1)
    work = WORKLOADS["mlp"]
    train, _ = work.build_data(0)
    batch = work.global_batch // world
    torch.manual_seed(0)
    model = DistributedDataParallel(work.build_model())
    opt = torch.optim.SGD(model.parameters(), lr=work.lr)
    g = torch.Generator().manual_seed(rank)
    norm_s = [0.0]
    plain = reducer_module.bucket_sq_norm

    def timed_norm(buffer):
        t = time.perf_counter()
        out = plain(buffer)
        norm_s[0] += time.perf_counter() - t
        return out

    # the local norms are taken during backward, the reduced ones after (both in engine/reducer.py)
    reducer_module.bucket_sq_norm = timed_norm

    estimator = NoiseScaleEstimator()  # one estimate across the variants that measure

    def round_ms(variant: str) -> float:
        measure, every, both = VARIANTS[variant]
        observer = NoiseScaleObserver(every=every, reduced_norm=both, estimator=estimator)
        model.set_noise_scale_observer(observer if measure else None)
        t0 = time.perf_counter()
        for _ in range(steps):
            idx = torch.randint(0, len(train), (batch,), generator=g)
            x, y = train.x[idx], train.y[idx]
            opt.zero_grad(set_to_none=True)
            work.loss(model(x), y).mean().backward()
            # the Trainer's skip-check norm, taken in every variant; when the engine measured the
            # local norm, its square is the big-batch norm (train/trainer.py)
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
            float(norm)
            opt.step()
        return (time.perf_counter() - t0) * 1e3 / steps

    names = list(VARIANTS)
    for name in names:  # warm-up
        round_ms(name)
    times: dict[str, list[float]] = {n: [] for n in names}
    share: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotating order
            norm_s[0] = 0.0
            ms = round_ms(name)
            times[name].append(ms)
            share[name].append(norm_s[0] * 1e3 / steps / ms)
    gns = estimator.b_simple
    model.close()
    return dict(times=times, share=share, batch=batch, gns=gns)


def run(rounds: int, steps: int, workers: int = 2) -> NoiseScaleCost:
    r0 = run_ranks(_rank, workers, rounds, steps, timeout_s=1800)[0]
    off = r0["times"]["off"]
    variants = []
    for name, times in r0["times"].items():
        ratios = [a / b for a, b in zip(times, off, strict=True)] if name != "off" else None
        deciles = statistics.quantiles(ratios, n=10) if ratios else None
        variants.append(
            VariantCost(
                variant=name,
                step_ms=statistics.median(times),
                ratio_median=statistics.median(ratios) if ratios else None,
                ratio_p10=deciles[0] if deciles else None,
                ratio_p90=deciles[-1] if deciles else None,
                norm_share_median=statistics.median(r0["share"][name]),
                norm_share_p90=statistics.quantiles(r0["share"][name], n=10)[-1],
            )
        )
    return NoiseScaleCost(
        workers=workers,
        per_worker_batch=r0["batch"],
        rounds=rounds,
        steps_per_round=steps,
        variants=variants,
        gns_per_worker_batches=r0["gns"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=8, help="steps per round, a multiple of 8")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    if args.rounds < 3 or args.steps < 8 or args.steps % 8:
        parser.error("--rounds must be >= 3, --steps a positive multiple of 8 (every 8 must measure alike)")
    result = run(args.rounds, args.steps)
    print(
        f"mlp, {result.workers} workers x {result.per_worker_batch} samples, {result.rounds} rounds of "
        f"{result.steps_per_round} steps per variant, rotating order"
    )
    header = f"{'variant':<22} {'ms/step':>8}  {'ratio to off, median (p10-p90)':<32}"
    print(header + " norms' share, median (p90)")
    for v in result.variants:
        ratio = ""
        if v.ratio_median is not None:
            ratio = f"{v.ratio_median:.4f} ({v.ratio_p10:.4f}-{v.ratio_p90:.4f})"
        share = f"{v.norm_share_median:.2%} ({v.norm_share_p90:.2%})"
        print(f"{v.variant:<22} {v.step_ms:8.2f}  {ratio:<32} {share}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(result), f, indent=2)


if __name__ == "__main__":
    main()
