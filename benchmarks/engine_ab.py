"""Old vs new engine on gloo, in alternating rounds in one run: did an engine change cost time?

    python benchmarks/engine_ab.py [--models mlp] [--rounds 20] [--steps 5] [--json out.json]
    python benchmarks/engine_ab.py --base REF [--transport gloo|shm] [--models mlp,transformer] ...
                                  [--no-noise-scale] [--workers N] [--per-process]

With `--base REF` the variants are `torch` (torch DDP), `base` (dpscale's engine as it is at git
REF, loaded from `git archive REF src/dpscale` as a package of its own) and `head` (the engine in
this tree), all three built as the benches build them (engine/factory.wrap: bucket_cap_mb=25,
gradient_as_bucket_view=True), dpscale on `--transport`. `--no-noise-scale` turns dpscale's
gradient-noise-scale measurement off in base and head (`set_noise_scale_observer(None)`, as the
Trainer's --no-noise-scale does): the engines then do the work torch's does, nothing more.
A step is bench/scaling_rank.timed_step (zero_grad
+ forward + mean loss + backward + SGD step) on a fixed batch, as in `dpscale bench engine`.

`--per-process` starts each variant in ranks of its own, afresh every round (variants rotating):
in one process the variants share the allocator and the caches, so one's freed blocks are the
next one's, which can hide what a model's own memory reuse costs (benchmarks/engine_fresh_ab.py
starts each in a fresh interpreter instead, as torchrun starts workers).

Without `--base`, the variants of the 2026-12-01 per-parameter question:

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
import io
import json
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from dpscale import DistributedDataParallel
from dpscale.lab.bench.rounds import fixed_round_sizes, run_rounds
from dpscale.lab.bench.scaling_rank import timed_step
from dpscale.lab.multirank import run_ranks
from dpscale.lab.recipe import load_recipe
from dpscale.workloads import WORKLOADS

VARIANTS = ("torch", "old", "view", "new")
BASE_VARIANTS = ("torch", "base", "head")
PER_WORKER_BATCH = 64  # as `dpscale bench engine`
BASE_PACKAGE = "dpscale_base"  # the engine at --base, importable next to this tree's dpscale


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
    # with --base: median, p10, p90 over rounds of head / base (the change itself)
    head_over_base: list[float] | None = None
    # with --base, per variant: median over rounds of a step's CPU ms (both ranks' mean), and
    # median, p10, p90 of its ratio to torch's in the same round
    cpu_ms: dict[str, list[float]] | None = None


def _wrap(variant: str, module: nn.Module) -> nn.Module:
    if variant == "torch":
        return nn.parallel.DistributedDataParallel(module)
    ddp = DistributedDataParallel(module, transport="gloo", gradient_as_bucket_view=variant != "new")
    if variant == "old":
        for b in ddp.reducer.buckets:
            b.small = False  # no in-place small-tensor path
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


def extract_base(ref: str, into: Path) -> None:
    """`src/dpscale` as of git `ref`, as the package BASE_PACKAGE under `into` (its imports are
    relative, so it runs beside this tree's dpscale without touching it)."""
    repo = Path(__file__).resolve().parent.parent
    tar = subprocess.run(["git", "-C", str(repo), "archive", ref, "src/dpscale"], capture_output=True)
    if tar.returncode != 0:
        raise SystemExit(f"--base: git archive {ref!r} failed: {tar.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as t:
        t.extractall(into, filter="data")
    shutil.move(into / "src" / "dpscale", into / BASE_PACKAGE)


def _wrap_base(variant: str, module: nn.Module, transport: str, noise_scale: bool) -> nn.Module:
    # as engine/factory.wrap builds the engines for the benches
    if variant == "torch":
        return nn.parallel.DistributedDataParallel(module, bucket_cap_mb=25.0, gradient_as_bucket_view=True)
    if variant == "base":
        from dpscale_base import DistributedDataParallel as engine  # noqa: N813 - see extract_base
    else:
        engine = DistributedDataParallel
    ddp = engine(module, transport=transport, bucket_cap_mb=25.0, gradient_as_bucket_view=True)
    if not noise_scale:
        ddp.set_noise_scale_observer(None)
    return ddp


def built_variant(variant: str, work, transport: str, noise_scale: bool) -> tuple[nn.Module, torch.optim.SGD]:
    """`variant` of the recipe's model, seeded alike for every variant (the same initial weights),
    and its optimizer."""
    torch.manual_seed(0)
    model = _wrap_base(variant, work.build_model(), transport, noise_scale)
    return model, torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)


def rank_batch(work, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed batch every variant of rank `rank` trains on."""
    return work.make_batch(PER_WORKER_BATCH, torch.Generator().manual_seed(100 + rank))


def _rank_base(
    rank: int,
    world: int,
    name: str,
    rounds: int,
    steps: int,
    base_dir: str,
    transport: str,
    noise_scale: bool,
) -> dict:
    sys.path.insert(0, base_dir)
    torch.set_num_threads(1)
    work = load_recipe(name)
    batch = PER_WORKER_BATCH
    x, y = rank_batch(work, rank)
    models, opts = {}, {}
    for v in BASE_VARIANTS:
        models[v], opts[v] = built_variant(v, work, transport, noise_scale)

    def step(v: str) -> tuple[float, float]:
        # wall time, and the CPU time of the whole rank (backward's thread and gloo's): on a host
        # shared with other jobs the wall time swings with their load, the work done much less
        cpu = time.process_time()
        wall_s = timed_step(models[v], opts[v], work.loss, x, y, batch) / 1e3
        return wall_s, time.process_time() - cpu

    run_rounds(BASE_VARIANTS, step, fixed_round_sizes(2 * steps, steps))  # warm-up
    out = run_rounds(BASE_VARIANTS, step, fixed_round_sizes(rounds * steps, steps))
    for v, m in models.items():
        if v != "torch":
            m.close()
    return {
        "batch": batch,
        "rounds": {v: [sum(w for w, _ in r) * 1e3 / len(r) for r in out[v]] for v in BASE_VARIANTS},
        "cpu": {v: [sum(c for _, c in r) * 1e3 / len(r) for r in out[v]] for v in BASE_VARIANTS},
    }


def _rank_alone(
    rank: int,
    world: int,
    variant: str,
    name: str,
    steps: int,
    base_dir: str,
    transport: str,
    noise_scale: bool,
) -> dict:
    """One variant in a process of its own (--per-process): its allocator and caches hold only its
    own model, as in a training job; in a process shared by the variants one's freed memory is
    the next one's."""
    sys.path.insert(0, base_dir)
    torch.set_num_threads(1)
    work = load_recipe(name)
    x, y = rank_batch(work, rank)
    model, opt = built_variant(variant, work, transport, noise_scale)
    for _ in range(max(2, steps // 5)):  # warm-up
        timed_step(model, opt, work.loss, x, y, PER_WORKER_BATCH)
    cpu = time.process_time()
    wall = [timed_step(model, opt, work.loss, x, y, PER_WORKER_BATCH) for _ in range(steps)]
    cpu_ms = (time.process_time() - cpu) * 1e3 / steps
    if variant != "torch":
        model.close()
    return {"batch": PER_WORKER_BATCH, "wall": statistics.median(wall), "cpu": cpu_ms}


def run_per_process(
    name: str, rounds: int, steps: int, workers: int, base: str, transport: str, noise_scale: bool
) -> EngineAB:
    """--per-process: each round starts every variant in fresh ranks, in a rotating order; a
    round's figure is the median step of its slower rank."""
    per_round: dict[str, list[float]] = {v: [] for v in BASE_VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in BASE_VARIANTS}
    with tempfile.TemporaryDirectory(prefix="engine-ab-") as tmp:
        extract_base(base, Path(tmp))
        for k in range(rounds):
            order = BASE_VARIANTS[k % 3 :] + BASE_VARIANTS[: k % 3]
            for v in order:
                args = (v, name, steps, tmp, transport, noise_scale)
                ranks = run_ranks(_rank_alone, workers, *args, timeout_s=3600)
                per_round[v].append(max(r["wall"] for r in ranks))
                cpu[v].append(statistics.mean(r["cpu"] for r in ranks))
    figures = []
    for v in BASE_VARIANTS:
        ratios = [a / t for a, t in zip(per_round[v], per_round["torch"], strict=True)]
        figures.append(VariantFigure(v, statistics.median(per_round[v]), *median_p10_p90(ratios)))
    change = median_p10_p90([h / b for h, b in zip(per_round["head"], per_round["base"], strict=True)])
    cpu_ms = {
        v: [
            statistics.median(cpu[v]),
            *median_p10_p90([a / t for a, t in zip(cpu[v], cpu["torch"], strict=True)]),
        ]
        for v in BASE_VARIANTS
    }
    return EngineAB(name, workers, PER_WORKER_BATCH, rounds, steps, figures, change, cpu_ms)


def run(
    name: str,
    rounds: int,
    steps: int,
    workers: int = 2,
    *,
    base: str | None = None,
    transport: str = "gloo",
    noise_scale: bool = True,
) -> EngineAB:
    variants = VARIANTS if base is None else BASE_VARIANTS
    if base is None:
        ranks = run_ranks(_rank, workers, name, rounds, steps, timeout_s=3600)
    else:
        with tempfile.TemporaryDirectory(prefix="engine-ab-") as tmp:
            extract_base(base, Path(tmp))
            args = (name, rounds, steps, tmp, transport, noise_scale)
            ranks = run_ranks(_rank_base, workers, *args, timeout_s=3600)
    # a round counts at its slower rank
    per_round = {v: [max(r["rounds"][v][k] for r in ranks) for k in range(rounds)] for v in variants}
    figures = []
    for v in variants:
        ratios = [a / t for a, t in zip(per_round[v], per_round["torch"], strict=True)]
        figures.append(VariantFigure(v, statistics.median(per_round[v]), *median_p10_p90(ratios)))
    change = None
    if base is not None:
        change = median_p10_p90([h / b for h, b in zip(per_round["head"], per_round["base"], strict=True)])
        cpu = {v: [statistics.mean(r["cpu"][v][k] for r in ranks) for k in range(rounds)] for v in variants}
        cpu_ms: dict[str, list[float]] | None = {}
        for v in variants:
            ratios = [a / t for a, t in zip(cpu[v], cpu["torch"], strict=True)]
            cpu_ms[v] = [statistics.median(cpu[v]), *median_p10_p90(ratios)]
    else:
        cpu_ms = None
    return EngineAB(name, workers, ranks[0]["batch"], rounds, steps, figures, change, cpu_ms)


def median_p10_p90(values: list[float]) -> list[float]:
    """The figure of record of a list of per-round ratios: [median, p10, p90]."""
    deciles = statistics.quantiles(values, n=10)
    return [statistics.median(values), deciles[0], deciles[-1]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp", help=f"comma-separated, from {', '.join(WORKLOADS)}")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--base", help="git ref: time its engine (variant base) against this tree's")
    parser.add_argument("--transport", default="gloo", choices=("gloo", "shm"), help="dpscale's, with --base")
    parser.add_argument(
        "--no-noise-scale", action="store_true", help="with --base: dpscale measures no gradient noise scale"
    )
    parser.add_argument(
        "--workers", type=int, default=2, help="ranks (1: each engine's cost with nothing to wait for)"
    )
    parser.add_argument(
        "--per-process",
        action="store_true",
        help="with --base: every variant in ranks of its own, fresh each round (--steps a round)",
    )
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    if not names or any(m not in WORKLOADS for m in names):
        parser.error(f"--models: choose from {', '.join(WORKLOADS)}")
    if args.rounds < 3 or args.steps < 1:
        parser.error("--rounds must be >= 3 and --steps >= 1")
    if args.transport != "gloo" and args.base is None:
        parser.error("--transport needs --base")
    if args.no_noise_scale and args.base is None:
        parser.error("--no-noise-scale needs --base")
    if args.per_process and args.base is None:
        parser.error("--per-process needs --base")
    if not 1 <= args.workers <= 8:
        parser.error(f"--workers must be from 1 to 8, got {args.workers}")
    results = []
    for name in names:
        options = {"base": args.base, "transport": args.transport, "noise_scale": not args.no_noise_scale}
        if args.per_process:
            result = run_per_process(name, args.rounds, args.steps, args.workers, **options)  # type: ignore[arg-type]
        else:
            result = run(name, args.rounds, args.steps, args.workers, **options)
        results.append(result)
        print(
            f"{name}: {result.workers} workers x {result.per_worker_batch} samples, {args.transport}, "
            f"{result.rounds} rounds of {result.steps_per_round} steps"
            + (", dpscale without noise-scale measurement" if args.no_noise_scale else "")
        )
        for f in result.figures:
            print(
                f"  {f.variant:6s} {f.median_ms:8.2f} ms   /torch {f.ratio_median:.3f} "
                f"({f.ratio_p10:.3f}-{f.ratio_p90:.3f})"
            )
        if result.head_over_base is not None:
            median, p10, p90 = result.head_over_base
            print(f"  head / base {median:.3f} ({p10:.3f}-{p90:.3f})")
        for v, (ms, median, p10, p90) in (result.cpu_ms or {}).items():
            print(f"  {v:6s} CPU {ms:8.2f} ms/step   /torch {median:.3f} ({p10:.3f}-{p90:.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)


if __name__ == "__main__":
    main()
