"""Engine benchmark: dpscale vs torch DDP vs an unsynchronized worker, side by side in one run.

All engines live in the same ranks and take turns (rounds of a few steps each, in rotating
order), so slow drift of a shared, noisy machine hits all of them alike. A step is timed on every
rank; the step's time is the slowest rank's, since that is what the next collective waits for.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ..testing.multirank import run_ranks
from ..workloads import get_workload
from .engines import ENGINES, parse_engines, wrap


@dataclass
class EngineFigures:
    engine: str
    step_ms_median: float
    step_ms_p10: float
    step_ms_p90: float


@dataclass
class EngineBenchResult:
    model: str
    world_size: int
    per_worker_batch: int
    threads_per_worker: int
    rounds: int
    steps_per_round: int
    engines: list[EngineFigures]
    # per dpscale engine: [median, p10, p90] over rounds of (its round median / torch's round median)
    ratios_vs_torch: dict[str, list[float]]

    def to_dict(self) -> dict:
        return asdict(self)


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _rank_bench(
    rank: int,
    world: int,
    model_name: str,
    batch: int,
    engines: list[str],
    rounds: int,
    steps: int,
    warmup: int,
) -> dict[str, list[list[float]]]:
    workload = get_workload(model_name)
    train, _ = workload.build_data(0)
    g = torch.Generator().manual_seed(100 + rank)
    idx = torch.randint(0, len(train), (batch,), generator=g).tolist()
    x, y = train.batch(idx)
    runs = {}
    for e in engines:
        torch.manual_seed(0)
        model = wrap(workload.build_model(), e)
        runs[e] = (model, torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9))

    def step(e: str) -> float:
        model, opt = runs[e]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        (workload.loss_sum(model(x), y) / batch).backward()
        opt.step()
        return (time.perf_counter() - t0) * 1e3

    for e in engines:
        for _ in range(warmup):
            step(e)
    times: dict[str, list[list[float]]] = {e: [] for e in engines}
    for r in range(rounds):
        order = engines[r % len(engines) :] + engines[: r % len(engines)]
        for e in order:
            times[e].append([step(e) for _ in range(steps)])
    return times


def run(
    model: str = "mlp",
    world_size: int = 2,
    per_worker_batch: int = 64,
    engines: list[str] | None = None,
    rounds: int = 15,
    steps_per_round: int = 4,
    warmup: int = 3,
) -> EngineBenchResult:
    engines = list(engines or ENGINES)
    per_rank = run_ranks(
        _rank_bench,
        world_size,
        model,
        per_worker_batch,
        engines,
        rounds,
        steps_per_round,
        warmup,
        timeout_s=1800,
    )
    # slowest rank per step
    slowest = {
        e: [[max(rk[e][r][s] for rk in per_rank) for s in range(steps_per_round)] for r in range(rounds)]
        for e in engines
    }
    figures = []
    for e in engines:
        flat = [t for rnd in slowest[e] for t in rnd]
        figures.append(EngineFigures(e, statistics.median(flat), _quantile(flat, 0.1), _quantile(flat, 0.9)))
    ratios_vs_torch = {}
    for e in engines:
        if e.startswith("dpscale") and "torch" in engines:
            per_round = [
                statistics.median(a) / statistics.median(b)
                for a, b in zip(slowest[e], slowest["torch"], strict=True)
            ]
            ratios_vs_torch[e] = [
                statistics.median(per_round),
                _quantile(per_round, 0.1),
                _quantile(per_round, 0.9),
            ]
    return EngineBenchResult(
        model, world_size, per_worker_batch, 1, rounds, steps_per_round, figures, ratios_vs_torch
    )


def format_result(res: EngineBenchResult) -> str:
    lines = [
        f"model={res.model} world_size={res.world_size} per_worker_batch={res.per_worker_batch} "
        f"threads/worker={res.threads_per_worker} rounds={res.rounds}x{res.steps_per_round} steps",
        f"{'engine':<14}{'median ms':>12}{'p10 ms':>10}{'p90 ms':>10}",
    ]
    for f in res.engines:
        lines.append(f"{f.engine:<14}{f.step_ms_median:>12.2f}{f.step_ms_p10:>10.2f}{f.step_ms_p90:>10.2f}")
    for e, (med, p10, p90) in res.ratios_vs_torch.items():
        lines.append(f"{e}/torch step-time ratio: {med:.3f} (p10 {p10:.3f}, p90 {p90:.3f} over rounds)")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="mlp,transformer", help="comma-separated built-in models")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--per-worker-batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=15, help="rounds; each engine runs once per round")
    p.add_argument("--steps-per-round", type=int, default=4)
    p.add_argument(
        "--engines", default=",".join(ENGINES), help="comma-separated: dpscale, dpscale-gloo, torch, local"
    )
    p.add_argument("--json", action="store_true", help="print the results as a JSON list on the last line")


def run_from_args(args: argparse.Namespace) -> int:
    models = [m for m in args.models.split(",") if m]
    for m in models:
        get_workload(m)  # unknown names fail before anything starts
    if args.world_size < 1 or args.per_worker_batch < 1 or args.rounds < 1 or args.steps_per_round < 1:
        raise ValueError("--world-size, --per-worker-batch, --rounds and --steps-per-round must be >= 1")
    results = []
    for m in models:
        res = run(
            m,
            args.world_size,
            args.per_worker_batch,
            parse_engines(args.engines),
            rounds=args.rounds,
            steps_per_round=args.steps_per_round,
        )
        print(format_result(res), flush=True)
        results.append(res.to_dict())
    if args.json:
        print(json.dumps(results))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
