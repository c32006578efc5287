"""Where the shm all-reduce's time goes inside an mlp training step at N = 2 (issue 32, weak scaling).

    python benchmarks/archive/step_reduce_phases.py phases [--steps 30]
    python benchmarks/archive/step_reduce_phases.py caps [--caps default,4,8] [--rounds 16]
    python benchmarks/archive/step_reduce_phases.py parts [--rounds 12]

Two ranks (run_ranks), the built-in mlp (lab's weak-scaling model), 64 samples a rank, SGD, one
intra-op thread, dpscale's engine with gradient_as_bucket_view=True on the shm transport.

`phases`: every all-reduce of a bucket of over 100 KB timed in its three phases (the first barrier:
waiting for the peer's arrival; this rank's part summed and spread; the second barrier) inside the
steps, then the same all-reduce called 10 times right after, its data hot. Printed per rank: the
step's median ms, and the phases' medians in the steps and after them.

`caps`: the step time of engines that differ only in bucket_cap_mb ("default" leaves it unset),
and of the unsynchronized model (`local`), built from one seed in the same ranks and taking turns in
rounds of 5 steps (rotating order); a step's time is the slower rank's.

`parts`: what the engine adds to a step at N = 2, taken apart by turning its pieces off, in the same
turns as `caps`: the engine as is (`ddp`); its reduction's sum and spread left out, its two barriers
kept (`barriers`: the rank waits for its peer as it would, the sum's time and memory traffic
gone); the step under no_sync (`no_sync`: the gradients still copied into their buckets, nothing
waited for); and the unsynchronized model (`local`).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from dpscale.lab.multirank import run_ranks

BATCH = 64


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 1024, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _phases(rank: int, world: int, steps: int) -> dict:
    import dpscale
    from dpscale.workloads import models

    torch.set_num_threads(1)
    torch.manual_seed(0)
    ddp = dpscale.DistributedDataParallel(models.mlp(), gradient_as_bucket_view=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = _batch()
    transport = ddp.transport
    phases: list[tuple[float, float, float]] = []

    def timed_in_place(region, between_hosts) -> None:  # SharedMemoryTransport._all_reduce_in_place, timed
        t0 = time.perf_counter()
        transport._wait_all(transport._arrive(), "inputs ready")
        t1 = time.perf_counter()
        if region.hi > region.lo:
            region.sum_and_spread(between_hosts)
        t2 = time.perf_counter()
        transport._wait_all(transport._arrive(), "results written")
        t3 = time.perf_counter()
        if region.mine.numel() * region.mine.element_size() > 100_000:
            phases.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3))

    transport._all_reduce_in_place = timed_in_place
    for _ in range(5):
        _step(ddp, opt, x, y)
    phases.clear()
    step_ms = []
    for _ in range(steps):
        t0 = time.perf_counter()
        _step(ddp, opt, x, y)
        step_ms.append((time.perf_counter() - t0) * 1e3)
    in_step = list(phases)
    phases.clear()
    for _ in range(10):
        for bucket in ddp.reducer.buckets:
            transport.all_reduce(bucket.buffer)

    def medians(rows: list[tuple[float, float, float]]) -> list[float]:
        return [round(statistics.median(col), 3) for col in zip(*rows, strict=True)]

    return {"step_ms": round(statistics.median(step_ms), 2), "in_step": medians(in_step), "hot": medians(phases)}


def _caps(rank: int, world: int, caps: list[float | None], rounds: int) -> dict[str, list[float]]:
    import dpscale
    from dpscale.workloads import models

    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = models.mlp()
    variants: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
    for cap in caps:
        kwargs = {} if cap is None else {"bucket_cap_mb": cap}
        ddp = dpscale.DistributedDataParallel(copy.deepcopy(base), gradient_as_bucket_view=True, **kwargs)
        variants["default" if cap is None else f"{cap:g} MB"] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.01))
    local = copy.deepcopy(base)
    variants["local"] = (local, torch.optim.SGD(local.parameters(), lr=0.01))
    x, y = _batch()
    names = list(variants)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds + 1):  # round 0 warms up
        for name in names[r % len(names) :] + names[: r % len(names)]:
            model, opt = variants[name]
            for _ in range(5):
                t0 = time.perf_counter()
                _step(model, opt, x, y)
                if r:
                    times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def _parts(rank: int, world: int, rounds: int) -> dict[str, list[float]]:
    import dpscale
    from dpscale.workloads import models

    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = models.mlp()
    ddp = dpscale.DistributedDataParallel(copy.deepcopy(base), gradient_as_bucket_view=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    transport = ddp.transport
    reduce_in_place = transport._all_reduce_in_place
    summing = [True]

    def barriers_only(region, between_hosts) -> None:  # _all_reduce_in_place without the sum
        if summing[0]:
            reduce_in_place(region, between_hosts)
            return
        transport._wait_all(transport._arrive(), "inputs ready")
        transport._wait_all(transport._arrive(), "results written")

    transport._all_reduce_in_place = barriers_only
    local = copy.deepcopy(base)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.01)
    x, y = _batch()

    def step(name: str) -> None:
        summing[0] = name == "ddp"
        if name == "local":
            _step(local, local_opt, x, y)
        elif name == "no_sync":
            with ddp.no_sync():
                _step(ddp, opt, x, y)
        else:
            _step(ddp, opt, x, y)

    names = ["ddp", "barriers", "no_sync", "local"]
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds + 1):  # round 0 warms up
        for name in names[r % len(names) :] + names[: r % len(names)]:
            for _ in range(5):
                t0 = time.perf_counter()
                step(name)
                if r:
                    times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def _print_slower(per_rank: list[dict[str, list[float]]]) -> None:
    for name in per_rank[0]:
        slower = [max(steps) for steps in zip(*(r[name] for r in per_rank), strict=True)]
        deciles = statistics.quantiles(slower, n=10)
        print(f"{name:8s} {statistics.median(slower):6.2f} ms (p10 {deciles[0]:.2f}, p90 {deciles[-1]:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["phases", "caps", "parts"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--caps", default="default,4,8", help="bucket_cap_mb values; 'default' leaves it unset")
    parser.add_argument("--rounds", type=int, default=16)
    args = parser.parse_args()
    if args.what == "phases":
        for rank, got in enumerate(run_ranks(_phases, 2, args.steps, timeout_s=600)):
            print(f"rank {rank}: step {got['step_ms']} ms; phases (first barrier, sum and spread, second")
            print(f"  barrier) in the steps {got['in_step']} ms, hot after them {got['hot']} ms")
        return
    if args.what == "parts":
        _print_slower(run_ranks(_parts, 2, args.rounds, timeout_s=900))
        return
    caps = [None if c == "default" else float(c) for c in args.caps.split(",")]
    _print_slower(run_ranks(_caps, 2, caps, args.rounds, timeout_s=900))


if __name__ == "__main__":
    main()
