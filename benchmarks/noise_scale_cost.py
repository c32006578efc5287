"""What measuring the gradient noise scale costs: the mlp workload at 2 workers, on and off.

    python benchmarks/noise_scale_cost.py [--rounds 30] [--steps 10] [--json out.json]

Both ranks train the `mlp` workload (its default global batch, 64 per worker, SGD) with one
dpscale engine whose reducer takes the squared norm of each bucket before and after the reduction
(`measure_noise_scale`) in one round and not in the next, alternating which goes first. A step is
zero_grad + forward + loss + backward + optimizer step, one intra-op thread per worker. The figure
of record is the median over rounds of (on / off) per-step time, with its 10th-90th percentiles;
absolute times on a shared host mean little. On a loaded host that ratio spreads by tens of percent
per round, so the run also times the norms themselves inside the measured rounds (a wrapper around
`bucket_sq_norm` where the reducer calls it: engine/readiness.py and engine/finalize.py): their
share of the step is the direct, steadier figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from dpscale import DistributedDataParallel
from dpscale.engine import finalize, readiness
from dpscale.multirank import run_ranks
from dpscale.workloads import WORKLOADS


@dataclass
class NoiseScaleCost:
    workers: int
    noise_scale_every: int  # measured on every this many steps
    per_worker_batch: int
    rounds: int
    steps_per_round: int
    off_ms: float  # median over rounds of the mean step, rank 0
    on_ms: float
    ratio_median: float  # on / off per round pair, rank 0
    ratio_p10: float
    ratio_p90: float
    norm_share_median: float  # time inside the norms / step time, per measured round, rank 0
    norm_share_p90: float
    gns_per_worker_batches: float | None  # the engine's figure at the end, as a sanity check


def _rank(rank: int, world: int, rounds: int, steps: int, every: int) -> dict:
    torch.set_num_threads(1)
    work = WORKLOADS["mlp"]
    train, _ = work.build_data(0)
    batch = work.global_batch // world
    torch.manual_seed(0)
    model = DistributedDataParallel(work.build_model())
    opt = torch.optim.SGD(model.parameters(), lr=work.lr)
    g = torch.Generator().manual_seed(rank)
    norm_s = [0.0]
    plain = readiness.bucket_sq_norm

    def timed_norm(buffer):
        t = time.perf_counter()
        out = plain(buffer)
        norm_s[0] += time.perf_counter() - t
        return out

    # the local norms are taken during backward (readiness.py), the reduced ones after (finalize.py)
    readiness.bucket_sq_norm = finalize.bucket_sq_norm = timed_norm

    model.reducer.noise_scale_every = every

    def round_ms(measure: bool) -> float:
        model.reducer.measure_noise_scale = measure
        t0 = time.perf_counter()
        for _ in range(steps):
            idx = torch.randint(0, len(train), (batch,), generator=g)
            x, y = train.x[idx], train.y[idx]
            opt.zero_grad(set_to_none=True)
            work.loss(model(x), y).mean().backward()
            opt.step()
        return (time.perf_counter() - t0) * 1e3 / steps

    round_ms(True), round_ms(False)  # warm-up
    on, off, share = [], [], []
    for r in range(rounds):
        for measure in (True, False) if r % 2 == 0 else (False, True):
            norm_s[0] = 0.0
            ms = round_ms(measure)
            (on if measure else off).append(ms)
            if measure:
                share.append(norm_s[0] * 1e3 / steps / ms)
    gns = model.reducer.noise_scale.b_simple
    model.close()
    return dict(on=on, off=off, share=share, batch=batch, gns=gns)


def run(rounds: int, steps: int, every: int = 1, workers: int = 2) -> NoiseScaleCost:
    r0 = run_ranks(_rank, workers, rounds, steps, every, timeout_s=1800)[0]
    ratios = [a / b for a, b in zip(r0["on"], r0["off"], strict=True)]
    deciles = statistics.quantiles(ratios, n=10)
    return NoiseScaleCost(
        workers=workers,
        noise_scale_every=every,
        per_worker_batch=r0["batch"],
        rounds=rounds,
        steps_per_round=steps,
        off_ms=statistics.median(r0["off"]),
        on_ms=statistics.median(r0["on"]),
        ratio_median=statistics.median(ratios),
        ratio_p10=deciles[0],
        ratio_p90=deciles[-1],
        norm_share_median=statistics.median(r0["share"]),
        norm_share_p90=statistics.quantiles(r0["share"], n=10)[-1],
        gns_per_worker_batches=r0["gns"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--every", type=int, default=8, help="measure on every this many steps (8)")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    if args.rounds < 3 or args.steps < 1 or args.every < 1:
        parser.error("--rounds must be >= 3, --steps and --every >= 1")
    result = run(args.rounds, args.steps, args.every)
    print(
        f"mlp, {result.workers} workers x {result.per_worker_batch} samples, {result.rounds} rounds of "
        f"{result.steps_per_round} steps, measured every {result.noise_scale_every}\n"
        f"noise scale off {result.off_ms:.2f} ms/step | on {result.on_ms:.2f} ms/step\n"
        f"on/off: {result.ratio_median:.4f} ({result.ratio_p10:.4f}-{result.ratio_p90:.4f})\n"
        f"time in the norms / step: {result.norm_share_median:.2%} (p90 {result.norm_share_p90:.2%})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(result), f, indent=2)


if __name__ == "__main__":
    main()
