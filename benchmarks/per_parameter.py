"""Per-parameter-tensor cost of the engine: torch DDP vs dpscale at one worker on gloo.

    python benchmarks/per_parameter.py [--rounds 40] [--steps 10] [--base REF] [--json out.json]

A model of 800 small parameter tensors (200 x Linear(16,16) + LayerNorm(16), batch 8) makes the
per-tensor work of an engine (its gradient hooks, bucket copies, bookkeeping) dominate a step. At
one worker the all-reduce is nearly free, so (engine step - bare step) / 800 is that work. The
variants (bare model, torch DDP, dpscale with its defaults and with
gradient_as_bucket_view=True) run in alternating rounds of `steps` steps in one
process; a round's ratio is dpscale's overhead over torch's, and the median of those ratios is
the figure of record (an absolute time on a shared machine is not). A step is zero_grad +
forward + sum + backward, no optimizer (identical for all). With `--base REF` dpscale's engine as
it is at git REF (benchmarks/engine_ab.py's extract_base) takes turns too, with its defaults as
`dpscale`: its overhead over torch's, and this tree's step over its, measure an engine change.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from engine_ab import BASE_PACKAGE, extract_base, median_p10_p90
from torch import nn

from dpscale import DistributedDataParallel

LAYERS = 200
WIDTH = 16
BATCH = 8


def build() -> nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(LAYERS):
        blocks += [nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)]
    return nn.Sequential(*blocks)


@dataclass
class PerParameterResult:
    tensors: int
    rounds: int
    steps_per_round: int
    bare_ms: float  # median over rounds of the mean step
    torch_ms: float
    dpscale_ms: float
    torch_us_per_tensor: float
    dpscale_us_per_tensor: float
    ratio_median: float  # dpscale overhead / torch overhead, median over rounds
    ratio_p10: float
    ratio_p90: float
    # dpscale with gradient_as_bucket_view=True (.grad left as bucket views, no copy back)
    dpscale_view_ms: float
    dpscale_view_us_per_tensor: float
    view_ratio_median: float
    view_ratio_p10: float
    view_ratio_p90: float
    # with --base: the engine at REF (defaults), its overhead / torch's and head / base per round
    base_ms: float | None = None
    base_ratio: list[float] | None = None  # median, p10, p90
    head_over_base: list[float] | None = None  # median, p10, p90 of dpscale step / base step


def run(rounds: int, steps: int, base_engine: type | None = None) -> PerParameterResult:
    torch.set_num_threads(1)
    x = torch.randn(BATCH, WIDTH)
    models = {
        "bare": build(),
        "torch": nn.parallel.DistributedDataParallel(build()),
        "dpscale": DistributedDataParallel(build(), transport="gloo"),
        "dpscale_view": DistributedDataParallel(build(), transport="gloo", gradient_as_bucket_view=True),
    }
    if base_engine is not None:
        models["base"] = base_engine(build(), transport="gloo")
    tensors = sum(1 for _ in models["bare"].parameters())

    def round_ms(model: nn.Module) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()
        return (time.perf_counter() - t0) * 1e3 / steps

    for model in models.values():  # warm-up: allocator, first-step work, lazy inits
        round_ms(model)
    times: dict[str, list[float]] = {k: [] for k in models}
    for r in range(rounds):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for name in order:
            times[name].append(round_ms(models[name]))

    def overhead_ratios(variant: str) -> list[float]:
        rounds_ = zip(times["bare"], times["torch"], times[variant], strict=True)
        return [(d - b) / (t - b) for b, t, d in rounds_ if t > b]

    ratios, view_ratios = overhead_ratios("dpscale"), overhead_ratios("dpscale_view")
    med = {k: statistics.median(v) for k, v in times.items()}
    deciles = statistics.quantiles(ratios, n=10)
    view_deciles = statistics.quantiles(view_ratios, n=10)
    base = {}
    if base_engine is not None:
        head_over_base = [h / b for h, b in zip(times["dpscale"], times["base"], strict=True)]
        base = {
            "base_ms": med["base"],
            "base_ratio": median_p10_p90(overhead_ratios("base")),
            "head_over_base": median_p10_p90(head_over_base),
        }
    return PerParameterResult(
        tensors=tensors,
        rounds=rounds,
        steps_per_round=steps,
        bare_ms=med["bare"],
        torch_ms=med["torch"],
        dpscale_ms=med["dpscale"],
        torch_us_per_tensor=(med["torch"] - med["bare"]) * 1e3 / tensors,
        dpscale_us_per_tensor=(med["dpscale"] - med["bare"]) * 1e3 / tensors,
        ratio_median=statistics.median(ratios),
        ratio_p10=deciles[0],
        ratio_p90=deciles[-1],
        dpscale_view_ms=med["dpscale_view"],
        dpscale_view_us_per_tensor=(med["dpscale_view"] - med["bare"]) * 1e3 / tensors,
        view_ratio_median=statistics.median(view_ratios),
        view_ratio_p10=view_deciles[0],
        view_ratio_p90=view_deciles[-1],
        **base,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--base", help="git ref: also time dpscale's engine as it is there")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    if args.rounds < 3 or args.steps < 1:
        parser.error("--rounds must be >= 3 and --steps >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        base_engine = None
        if args.base is not None:
            extract_base(args.base, Path(tmp))
            sys.path.insert(0, tmp)
            base_engine = importlib.import_module(BASE_PACKAGE).DistributedDataParallel
        dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", 1), rank=0, world_size=1)
        try:
            result = run(args.rounds, args.steps, base_engine)
        finally:
            dist.destroy_process_group()
    print(
        f"{result.tensors} parameter tensors, batch {BATCH}, {result.rounds} rounds of "
        f"{result.steps_per_round} steps\n"
        f"bare {result.bare_ms:.2f} ms | torch DDP {result.torch_ms:.2f} ms "
        f"({result.torch_us_per_tensor:.2f} us/tensor) | dpscale {result.dpscale_ms:.2f} ms "
        f"({result.dpscale_us_per_tensor:.2f} us/tensor)\n"
        f"dpscale/torch overhead: {result.ratio_median:.3f} ({result.ratio_p10:.3f}-{result.ratio_p90:.3f})\n"
        f"dpscale gradient_as_bucket_view=True {result.dpscale_view_ms:.2f} ms "
        f"({result.dpscale_view_us_per_tensor:.2f} us/tensor), overhead/torch's "
        f"{result.view_ratio_median:.3f} ({result.view_ratio_p10:.3f}-{result.view_ratio_p90:.3f})"
    )
    if result.base_ms is not None:
        (ratio, p10, p90), (change, c10, c90) = result.base_ratio, result.head_over_base
        print(
            f"base ({args.base}) {result.base_ms:.2f} ms, overhead/torch's {ratio:.3f} "
            f"({p10:.3f}-{p90:.3f}); dpscale / base step {change:.3f} ({c10:.3f}-{c90:.3f})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(result), f, indent=2)


if __name__ == "__main__":
    main()
