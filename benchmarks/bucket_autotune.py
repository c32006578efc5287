"""Bucket-size autotuning: the size `bucket_cap_mb="auto"` keeps, and its step time against 25 MB.

`python benchmarks/bucket_autotune.py [--model mlp] [--transport auto|gloo]`: two workers, one
thread each. The auto engine first tunes (its own schedule); then it and a 25 MB engine take turns
in rounds, and the medians and their ratio are printed with the tuner's per-candidate medians.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from dpscale import DistributedDataParallel
from dpscale.engine.autotune import CANDIDATES_MB, MEASURED_STEPS, WARMUP_STEPS
from dpscale.lab.bench.rounds import quantile as _quantile
from dpscale.lab.bench.scaling_rank import timed_step
from dpscale.lab.multirank import run_ranks
from dpscale.workloads import get_workload


def rank_main(rank: int, world: int, model_name: str, transport: str, rounds: int, batch: int) -> dict:
    w = get_workload(model_name)
    data, _ = w.build_data(0)
    x, y = data.batch(
        torch.randint(0, len(data), (batch,), generator=torch.Generator().manual_seed(rank)).tolist()
    )
    engines = {}
    for cap in ("auto", 25.0):
        torch.manual_seed(0)
        m = DistributedDataParallel(w.build_model(), bucket_cap_mb=cap, transport=transport)
        engines[cap] = (m, torch.optim.SGD(m.parameters(), lr=1e-4, momentum=0.9))

    def step(cap) -> float:
        m, opt = engines[cap]
        return timed_step(m, opt, w.loss_sum, x, y)

    for _ in range(len(CANDIDATES_MB) * (WARMUP_STEPS + MEASURED_STEPS) + 2):
        step("auto")  # the tuning schedule, then one step on the chosen buckets
    for _ in range(3):
        step(25.0)
    times = {"auto": [], 25.0: []}
    for r in range(rounds):
        for cap in ("auto", 25.0) if r % 2 == 0 else (25.0, "auto"):
            times[cap].append([step(cap) for _ in range(4)])
    return {"decision": engines["auto"][0].autotune_decision, "times": times}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mlp")
    p.add_argument("--transport", default="auto")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--per-worker-batch", type=int, default=64)
    args = p.parse_args()
    res = run_ranks(
        rank_main, 2, args.model, args.transport, args.rounds, args.per_worker_batch, timeout_s=1200
    )
    decision = res[0]["decision"]
    print(decision.describe())
    slowest = {
        cap: [
            [max(a, b) for a, b in zip(ra, rb, strict=True)]
            for ra, rb in zip(res[0]["times"][cap], res[1]["times"][cap], strict=True)
        ]
        for cap in ("auto", 25.0)
    }
    for cap, rounds in slowest.items():
        flat = [t for r in rounds for t in r]
        label = f"auto ({decision.chosen_mb:g} MB)" if cap == "auto" else "25 MB (default)"
        print(
            f"{label:<18} median {statistics.median(flat):7.2f} ms  p10 {_quantile(flat, 0.1):7.2f}  "
            f"p90 {_quantile(flat, 0.9):7.2f}"
        )
    ratios = [
        statistics.median(a) / statistics.median(b)
        for a, b in zip(slowest["auto"], slowest[25.0], strict=True)
    ]
    print(
        f"auto / 25 MB step-time ratio: {statistics.median(ratios):.3f} (p10 {_quantile(ratios, 0.1):.3f}, "
        f"p90 {_quantile(ratios, 0.9):.3f} over rounds)"
    )


if __name__ == "__main__":
    main()
