"""Measure a model's one-worker profile (`dpscale profile`, `measure`): a `ModelProfile` (profile.py).

Measured (`measure`): the workload runs alone on one worker (one fresh process, one intra-op thread
by default, as the scaling bench's workers). Each step is split into forward (zero_grad, forward,
loss), backward and optimizer (SGD with momentum, as the scaling bench), and a hook on every
parameter stamps when its gradient is ready. Figures are medians over the timed steps after warm-up.
In the same process, on a one-worker process group, the step is also timed wrapped in each engine
(dpscale, torch DDP), alternating with the bare model: the difference is what the engine adds
(copying gradients into buckets, hooks) with nothing to communicate.

Contention and sync terms (`measure(..., co_located=K)`): K workers on this machine step the bare model in
lockstep (a barrier before every step, as synchronized training aligns them, so their
memory-hungry phases coincide), alternating with steps where worker 0 runs alone; the median of
the per-round ratio (slowest worker together / worker 0 alone) is how much slower a worker computes
beside K-1 others. Alternating rounds make the ratio robust to other load on a shared machine.
The same K workers then calibrate the in-step sync terms of each local transport (sync.py): what a
synchronized step adds per all-reduce call and to compute, beyond the all-reduce bench's figures.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from dpscale.engine import DistributedDataParallel
from dpscale.engine.clock import clock_for
from dpscale.engine.compat.torch_args import move_to
from dpscale.engine.factory import DPSCALE_ON_SHM, PROFILE_ENGINES, wrap
from dpscale.lab.bench.rounds import run_rounds, timed_round_sizes
from dpscale.lab.predict import interfere
from dpscale.lab.predict import sync as syncs
from dpscale.lab.predict.bare import bare_model
from dpscale.lab.predict.profile import ModelProfile, ParamTiming, ProfileConfig, step_to_step_cv

# DPSCALE_ON_SHM: dpscale's engine also timed on a one-worker shm transport (where shm runs): its
# bookkeeping without gloo's thread hand-offs, the base for predicting dpscale on shm (model.py)

# The data path is timed for at least this long (and INPUT_CALLS batches): one call of a small
# task's collate is microseconds, a real image dataset's batch tens of milliseconds.
INPUT_MIN_S = 0.5
INPUT_CALLS = 5

# Timed rounds go on past `steps` until they cover this long: a step of half a millisecond needs
# thousands of samples before the median of a per-round difference stops moving (20 steps: 10 ms).
MIN_TIMED_S = 2.0
MAX_ROUNDS = 1000


def _rank_measure(
    rank: int, world_size: int, model_name: str, batch: int, steps: int, warmup: int, device: str = "cpu"
) -> dict:
    from dpscale.comm.select import shm_is_safe
    from dpscale.lab.recipe import load_recipe

    workload = load_recipe(model_name)
    dev = torch.device(device)
    # the engine's clock: host time on a CPU, CUDA events on a GPU (where host time is the launch)
    clock = clock_for(dev)
    x, y = move_to(workload.make_batch(batch, torch.Generator().manual_seed(100)), dev)

    def build(engine: str):
        torch.manual_seed(0)  # the same initial weights for every variant
        ids = [torch.cuda.current_device()] if dev.type == "cuda" else None
        model = wrap(workload.build_model().to(dev), engine, device_ids=ids)
        return model, torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)

    local, local_opt = build("local")
    named = [(n, p) for n, p in local.named_parameters() if p.requires_grad]
    # a parameter without a gradient keeps this stamp, from before every step: its ready time
    # comes out below zero, read as 0 (measure)
    stamps: list[Any] = [clock.stamp()] * len(named)
    for i, (_, p) in enumerate(named):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: stamps.__setitem__(i, clock.stamp()))
    names = [*PROFILE_ENGINES, *([DPSCALE_ON_SHM] if shm_is_safe() and dev.type == "cpu" else [])]
    engines = {e: build(e) for e in names}
    phases: list[tuple[float, float, float, list[float]]] = []
    totals: dict[str, list[float]] = {e: [] for e in ("local", *names)}

    def step(model, opt) -> tuple[Any, Any, Any, Any]:
        t0 = clock.stamp()
        opt.zero_grad(set_to_none=True)
        loss = workload.loss(workload.forward(model, x), y) / batch
        t1 = clock.stamp()
        loss.backward()
        t2 = clock.stamp()
        opt.step()
        t3 = clock.stamp()
        # a profile times each step on its own: on a GPU the step ends when the device is done
        clock.wait([t3])  # the step's last event: the ones before it on the stream are done too
        return t0, t1, t2, t3

    ms = clock.elapsed_ms

    variants = {"local": (local, local_opt), **engines}
    for _ in range(warmup):
        for m, o in variants.values():
            step(m, o)
    t0, *_, t3 = step(local, local_opt)
    # Each variant runs a round of several steps in turn: run one step each instead and every step
    # starts with caches the other variants filled, which slows the bare model more than the wrapped
    # ones and hides most of a small model's engine overhead (digits: 0.30 ms per-step alternation
    # vs 0.45 ms in rounds of 10, which is what a training run pays).
    per_round = syncs.steps_per_round(ms(t0, t3))

    def timed(name: str) -> float:
        t0, t1, t2, t3 = step(*variants[name])
        if name == "local":
            phases.append((ms(t0, t1), ms(t1, t2), ms(t2, t3), [ms(t1, t) for t in stamps]))
        return ms(t0, t3)

    sizes = timed_round_sizes(per_round, min_steps=steps, min_s=MIN_TIMED_S, max_rounds=MAX_ROUNDS)
    for name, rounds in run_rounds(list(variants), timed, sizes).items():
        # the rounds pair the variants in time: the engines' overheads are medians of per-round
        # differences, which a slow drift or a burst of load shifts far less than it shifts a
        # difference of medians
        totals[name] = [statistics.median(times) for times in rounds]
    for model, _ in engines.values():
        if isinstance(model, DistributedDataParallel):
            model.close()  # the shm transport's segments and the hooks, now rather than at exit
    # one generator for all the batches: each draws other items, as a loader does (the same items
    # every time would time the caches)
    draw = torch.Generator().manual_seed(7)
    return {
        "input_ms": time_input(lambda: workload.make_batch(batch, draw)),
        "names": [n for n, _ in named],
        "numel": [p.numel() for _, p in named],
        "nbytes": [p.numel() * p.element_size() for _, p in named],
        "phases": phases,
        "totals": totals,
        "per_round": per_round,  # the local variant's phases come in rounds of this many steps
    }


def time_input(make_batch, *, min_s: float = INPUT_MIN_S, min_calls: int = INPUT_CALLS) -> list[float]:
    """ms per call of `make_batch` (one batch of the task's data, collated), repeated for at least
    `min_calls` calls and `min_s` seconds: what one loader process delivers, with nothing else running."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - start < min_s:
        t0 = time.perf_counter()
        make_batch()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def input_rate(per_worker_batch: int, input_ms: list[float]) -> float | None:
    """Samples/s from the per-batch times (the median); None when too fast to time."""
    ms = statistics.median(input_ms)
    return 1e3 * per_worker_batch / ms if ms > 0 else None


def _rank_contention(
    rank: int, world_size: int, model_name: str, batch: int, steps: int, warmup: int
) -> list:
    import torch.distributed as dist

    bare = bare_model(model_name, batch, rank)

    def step(active: bool) -> float:
        dist.barrier()  # start together, as synchronized training does
        elapsed = 0.0
        if active:
            t0 = time.perf_counter()
            bare.step()
            elapsed = time.perf_counter() - t0
        t = torch.tensor([elapsed], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step counts at its slowest worker
        return t.item() * 1e3

    for _ in range(warmup):
        step(True)
    # rounds of one step each, which comes first alternating, so that drift favours neither
    rounds = run_rounds(["alone", "together"], lambda v: step(v == "together" or rank == 0), [1] * steps)
    return [t / a for [a], [t] in zip(rounds["alone"], rounds["together"], strict=True)]


def measure(
    model: str,
    per_worker_batch: int,
    *,
    steps: int = 20,
    warmup: int = 3,
    threads: int = 1,
    co_located: int = 1,
    device: str = "cpu",
) -> ModelProfile:
    """Profile `model` (a built-in workload or module:callable returning a Task) on one worker in a
    fresh process (see the module docstring)."""
    from dpscale.lab.bench.sysinfo import collect_system_info
    from dpscale.lab.multirank import run_ranks
    from dpscale.lab.recipe import load_recipe

    ProfileConfig(  # the flags' checks
        model=model,
        per_worker_batch=per_worker_batch,
        steps=steps,
        warmup=warmup,
        threads=threads,
        co_located=co_located,
        device=device,
    )
    load_recipe(model, check=True)  # a broken task fails here with one line, not in the rank
    timeout_s = 120 + 10 * (steps + warmup)
    (raw,) = run_ranks(
        _rank_measure,
        1,
        model,
        per_worker_batch,
        steps,
        warmup,
        device,
        threads=threads,
        timeout_s=timeout_s,
        backend="nccl" if device == "cuda" else "gloo",
    )
    med = statistics.median
    contention = {}
    if co_located > 1:
        per_rank = run_ranks(
            _rank_contention,
            co_located,
            model,
            per_worker_batch,
            steps,
            warmup,
            threads=threads,
            timeout_s=timeout_s * 2,
        )
        contention[co_located] = med(per_rank[0])
    fwd, bwd, opt, ready = zip(*raw["phases"], strict=True)
    local = raw["totals"]["local"]
    steps_ms = [f + b + o for f, b, o in zip(fwd, bwd, opt, strict=True)]
    params = tuple(
        ParamTiming(name, numel, nbytes, max(0.0, med(r[i] for r in ready)))
        for i, (name, numel, nbytes) in enumerate(zip(raw["names"], raw["numel"], raw["nbytes"], strict=True))
    )
    prof = ModelProfile(
        model=model,
        source="measured",
        per_worker_batch=per_worker_batch,
        forward_ms=med(fwd),
        backward_ms=med(bwd),
        optimizer_ms=med(opt),
        param_count=sum(raw["numel"]),
        param_bytes=sum(raw["nbytes"]),
        params=params,
        # a difference on a noisy machine can come out below zero; an engine adds >= 0
        engine_overhead_ms={
            e: max(0.0, med(t - t0 for t, t0 in zip(raw["totals"][e], local, strict=True)))
            for e in raw["totals"]
            if e != "local"
        },
        contention=contention,
        compute_cv=step_to_step_cv(steps_ms, raw["per_round"]),
        input_samples_per_s=input_rate(per_worker_batch, raw["input_ms"]),
        device=device,
        threads=threads,
        steps=len(fwd),
        warmup=warmup,
        system=collect_system_info(),
    )
    if co_located > 1:
        # with the engine's default buckets, as the scaling bench trains
        bucket_bytes = [b.nbytes for b in prof.buckets()]
        costs = [
            c
            for n in (1, co_located)  # 1: what the engine overheads above already hold (sync.py)
            for c in syncs.measure(
                model, per_worker_batch, bucket_bytes, n, threads=threads, compute_ms=prof.compute_ms
            )
        ]
        interference = interfere.measure(
            model, per_worker_batch, bucket_bytes, co_located, threads=threads, compute_ms=prof.compute_ms
        )
        prof = replace(prof, sync=tuple(costs), interference=interference)
    return prof
