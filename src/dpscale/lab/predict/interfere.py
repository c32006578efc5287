"""Overlap interference, measured here: how much slower a worker computes while reductions run beside it.

The timeline (timeline.py) hides a bucket's reduction under the rest of backward as if both ran at
full speed. They do not: the reduction takes cores (gloo's threads on a CPU; SMs and memory bandwidth
on a GPU) from the compute it overlaps. `dpscale profile --co-located K` measures it with K workers,
apart from any training run, alternating in rounds (so that other load hits both alike):

    free      the bare model's step, nothing else running
    overlap   the same step while a thread reduces the model's buckets on gloo, started with it
              (once per step, as the engine reduces during backward)

    interference = median over rounds of (overlap compute - free compute) / overlapped comm time

where the overlapped comm time is the reductions' time while the step computed (at most the step).
The model (model.py) stretches backward by interference x the communication it hides. Each figure is
the slowest rank's per step. On a GPU this probe does not run (the profile is a CPU's); GPU presets
carry a value of their own (cluster.py).
"""

from __future__ import annotations

import statistics
import threading
import time

from dpscale.errors import ConfigError
from dpscale.lab.bench.rounds import run_rounds
from dpscale.lab.predict.bare import bare_model
from dpscale.lab.predict.sync import steps_per_round

ROUNDS = 12


def _rank_interference(
    rank: int, world_size: int, model_name: str, batch: int, numels: list[int], rounds: int, per_round: int
) -> dict[str, list[list[tuple[float, float]]]]:
    import torch
    import torch.distributed as dist

    bare = bare_model(model_name, batch, rank)
    buffers = [torch.zeros(n) for n in numels]

    def reduce_all(out: list[float]) -> None:
        t0 = time.perf_counter()
        for buf in buffers:
            dist.all_reduce(buf)
        out.append(time.perf_counter() - t0)

    def step(overlap: bool) -> tuple[float, float]:
        comm: list[float] = []
        thread = threading.Thread(target=reduce_all, args=(comm,)) if overlap else None
        t0 = time.perf_counter()
        if thread is not None:
            thread.start()
        bare.step()
        compute = time.perf_counter() - t0
        if thread is not None:
            thread.join()
        return compute * 1e3, (comm[0] * 1e3 if comm else 0.0)

    for variant in (False, True):
        for _ in range(2):
            step(variant)
    # alternating rounds (bench/rounds.py): drift hits both alike
    return run_rounds(["free", "overlap"], lambda name: step(name == "overlap"), [per_round] * rounds)


def summarize(per_rank: list[dict]) -> float:
    """The interference factor from every rank's rounds (module docstring), >= 0."""
    ratios = []
    for free_rounds, over_rounds in zip(
        zip(*(r["free"] for r in per_rank), strict=True),
        zip(*(r["overlap"] for r in per_rank), strict=True),
        strict=True,
    ):
        # per step the slowest rank; per round the median over its steps
        free = statistics.median(max(s[0] for s in step) for step in zip(*free_rounds, strict=True))
        over_steps = list(zip(*over_rounds, strict=True))
        over = statistics.median(max(s[0] for s in step) for step in over_steps)
        comm = statistics.median(min(max(s[1] for s in step), max(s[0] for s in step)) for step in over_steps)
        if comm > 0:
            ratios.append((over - free) / comm)
    # a burst of other load can push a round either way; the factor is a fraction of the hidden time
    return min(1.0, max(0.0, statistics.median(ratios))) if ratios else 0.0


def measure(
    model: str,
    per_worker_batch: int,
    bucket_bytes: list[int],
    world_size: int,
    *,
    threads: int = 1,
    compute_ms: float,
) -> float:
    """The interference factor of `world_size` workers reducing `bucket_bytes` on gloo beside the model."""
    from dpscale.lab.multirank import run_ranks

    if world_size < 2:
        raise ConfigError(f"--co-located: interference needs >= 2 workers, got {world_size}")
    numels = [max(1, b // 4) for b in bucket_bytes]  # float32, as the engine's buckets
    per_round = steps_per_round(compute_ms)
    per_rank = run_ranks(
        _rank_interference,
        world_size,
        model,
        per_worker_batch,
        numels,
        ROUNDS,
        per_round,
        threads=threads,
        timeout_s=300 + 20 * ROUNDS,
    )
    return summarize(per_rank)
