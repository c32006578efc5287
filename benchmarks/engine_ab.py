"""Old vs new engine on gloo, in alternating rounds in one run: did an engine change cost time?

    python benchmarks/engine_ab.py [--models mlp] [--rounds 20] [--steps 5] [--json out.json]

Both ranks (world size 2, gloo, one intra-op thread each) hold the same workload wrapped four
ways and train them in turn, a round of `steps` steps each, the order rotating every round
(bench/rounds.py). A step is zero_grad + forward + loss + backward + SGD step, as in
`dpscale bench engine`; a round's time is its slower rank's. The variants:

- `torch`: torch DDP (gloo), the reference;
- `old`: dpscale on gloo as before the per-parameter change (ab6863d/cbd379f): every gradient
  copied into its bucket by the hook (the small-tensor in-place path switched off) and kept as
  the bucket view (`gradient_as_bucket_view=True`, what the engine always did then);
- `view`: dpscale on gloo with `gradient_as_bucket_view=True`: the engine as it was this morning
  (small-tensor buckets accumulate in place);
- `new`: dpscale on gloo with its defaults (`gradient_as_bucket_view=False`, torch's: the reduced
  values are copied back into gradients of their own).

Figures of record: per variant, the median over rounds of (variant / torch) with p10-p90.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from dpscale import DistributedDataParallel
from dpscale.bench.rounds import fixed_round_sizes, run_rounds
from dpscale.multirank import run_ranks
from dpscale.workloads import WORKLOADS

VARIANTS = ("torch", "old", "view", "new")


@dataclass
class VariantFigure:
    variant: str
    median_ms: float  # median over rounds of the round's mean step (slower rank)
    ratio_median: float  # variant / torch per round
    ratio_p10: float
    ratio_p90: float


@dataclass
class EngineAB:
    model: str
    workers: int
    per_worker_batch: int
    rounds: int
    steps_per_round: int
    figures: list[VariantFigure]


def _wrap(variant: str, module: nn.Module) -> nn.Module:
    if variant == "torch":
        return nn.parallel.DistributedDataParallel(module)
    ddp = DistributedDataParallel(module, transport="gloo", gradient_as_bucket_view=variant != "new")
    if variant == "old":
        ddp.reducer._small = [False] * len(ddp.reducer.buckets)  # no in-place small-tensor path
    return ddp


def _rank(rank: int, world: int, name: str, rounds: int, steps: int) -> dict:
    torch.set_num_threads(1)
    work = WORKLOADS[name]
    train, _ = work.build_data(0)
    batch = work.global_batch // world
    models, opts = {}, {}
    for v in VARIANTS:
        torch.manual_seed(0)
        models[v] = _wrap(v, work.build_model())
        opts[v] = torch.optim.SGD(models[v].parameters(), lr=work.lr, momentum=0.9)
    g = torch.Generator().manual_seed(rank)

    def step(v: str) -> float:
        idx = torch.randint(0, len(train), (batch,), generator=g)
        t0 = time.perf_counter()
        opts[v].zero_grad(set_to_none=True)
        work.loss(models[v](train.x[idx]), train.y[idx]).mean().backward()
        opts[v].step()
        return time.perf_counter() - t0

    run_rounds(VARIANTS, step, fixed_round_sizes(2 * len(VARIANTS), 2))  # warm-up
    out = run_rounds(VARIANTS, step, fixed_round_sizes(rounds * steps, steps))
    for m in models.values():
        if isinstance(m, DistributedDataParallel):
            m.close()
    return {"batch": batch, "rounds": {v: [sum(r) * 1e3 / len(r) for r in out[v]] for v in VARIANTS}}


def run(name: str, rounds: int, steps: int, workers: int = 2) -> EngineAB:
    ranks = run_ranks(_rank, workers, name, rounds, steps, timeout_s=3600)
    # a round counts at its slower rank
    per_round = {v: [max(r["rounds"][v][k] for r in ranks) for k in range(rounds)] for v in VARIANTS}
    figures = []
    for v in VARIANTS:
        ratios = [a / t for a, t in zip(per_round[v], per_round["torch"], strict=True)]
        deciles = statistics.quantiles(ratios, n=10)
        median_ms = statistics.median(per_round[v])
        figures.append(VariantFigure(v, median_ms, statistics.median(ratios), deciles[0], deciles[-1]))
    return EngineAB(name, workers, ranks[0]["batch"], rounds, steps, figures)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp", help=f"comma-separated, from {', '.join(WORKLOADS)}")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    if not names or any(m not in WORKLOADS for m in names):
        parser.error(f"--models: choose from {', '.join(WORKLOADS)}")
    if args.rounds < 3 or args.steps < 1:
        parser.error("--rounds must be >= 3 and --steps >= 1")
    results = []
    for name in names:
        result = run(name, args.rounds, args.steps)
        results.append(result)
        print(
            f"{name}: {result.workers} workers x {result.per_worker_batch} samples, gloo, "
            f"{result.rounds} rounds of {result.steps_per_round} steps"
        )
        for f in result.figures:
            print(
                f"  {f.variant:6s} {f.median_ms:8.2f} ms   /torch {f.ratio_median:.3f} "
                f"({f.ratio_p10:.3f}-{f.ratio_p90:.3f})"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)


if __name__ == "__main__":
    main()
