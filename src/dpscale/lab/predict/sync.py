"""What a synchronized step costs beyond compute and the all-reduce bench: the in-step sync terms.

The all-reduce bench times a collective in a tight loop: every rank is already waiting, its threads
are running and its caches hold the buffer. In training a worker computes first and then calls the
collective, so each call also pays for the peer that is still computing (the slowest worker sets
the pace), for waking the transport's threads (gloo hands every call to its own thread, and a
woken thread on a busy core waits for a scheduler slice) and for cold caches. And a worker that
waited computes its next step more slowly than one that never stops (its core went idle, its
caches were evicted). On a 2-core machine and sub-millisecond steps these are most of the step.

They are calibrated here, apart from any training run: N workers run the bare model in three
variants, alternating in rounds of at least 5 steps and 50 ms (so load on a shared machine hits
all alike):

    free      compute only, never synchronized (what the scaling bench's `local` engine measures)
    tight     the all-reduces of the model's buckets back to back, no compute (what the bench sees)
    in-step   compute, then the same all-reduces on the transport: a synchronized step, no engine

    call_overhead_ms = (in-step step - free compute - tight communication) / buckets,  >= 0
    tight_comm_ms    = the tight variant's time (the level of the bench's curve at this moment)

Every figure is the slowest rank's per step; per round the median over its steps, then the median
over rounds of the per-round difference (a burst of other load cancels within a round). The slower
compute after a wait is charged to the calls too: it exists only because there are calls.

World size 1 is calibrated as well: the profile's engine overheads were measured on a one-worker
gloo group, so they already hold gloo's one-worker call overhead; the model takes it out of them
before it adds the overhead of the transport and world size it predicts (model.py). Nothing of an
engine runs here (no hooks, no overlap): validate.py checks those against real engines.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

from dpscale.errors import ConfigError
from dpscale.lab.bench.rounds import run_rounds
from dpscale.lab.predict.bare import bare_model

SYNC_TRANSPORTS = ("gloo", "shm")
_MIN_STEPS_PER_ROUND = 5
# A round of each variant lasts at least this long, so that a sub-millisecond step is sampled
# hundreds of times per round instead of five.
_MIN_ROUND_S = 0.05
# Enough rounds for a stable median of per-round figures, few enough for a 0.5 s step.
BUDGET_S = 20.0
ROUNDS = (4, 48)


def steps_per_round(compute_ms: float) -> int:
    """Steps per round of each variant for a model whose step computes for `compute_ms`."""
    return min(500, max(_MIN_STEPS_PER_ROUND, math.ceil(_MIN_ROUND_S * 1e3 / max(compute_ms, 1e-3))))


@dataclass(frozen=True)
class SyncCost:
    """The in-step sync overhead of one transport at one world size (module docstring)."""

    transport: str
    world_size: int
    call_overhead_ms: float  # extra per all-reduce call inside a step, beyond free compute + tight loop
    free_compute_ms: float
    in_step_ms: float  # compute then every bucket's all-reduce
    tight_comm_ms: float  # every bucket's all-reduce, back to back
    bucket_bytes: tuple[int, ...]  # the buckets reduced (the engine's default layout)

    @property
    def buckets(self) -> int:
        return len(self.bucket_bytes)

    @property
    def step_comm_ms(self) -> float:
        """All a synchronized step spends on its calls: tight loop plus the in-step overhead."""
        return self.tight_comm_ms + self.call_overhead_ms * self.buckets


def _rank_sync(
    rank: int,
    world_size: int,
    model_name: str,
    batch: int,
    numels: list[int],
    transports: list[str],
    rounds: int,
    per_round: int,
) -> dict:
    from dpscale.lab.bench.transports import TRANSPORTS

    compute = bare_model(model_name, batch, rank).step

    opened = {t: TRANSPORTS[t].setup(rank, world_size) for t in transports}
    buffers = {t: [tr.buffer(n) for n in numels] for t, tr in opened.items()}
    variants: dict[str, str | None] = {"free": None}  # variant -> the transport it reduces on
    variants.update({f"{kind}:{t}": t for kind in ("tight", "in-step") for t in transports})

    def run(name: str) -> tuple[float, float]:
        t0 = time.perf_counter()
        if not name.startswith("tight"):
            compute()
        t1 = time.perf_counter()
        if (t := variants[name]) is not None:
            for buf in buffers[t]:
                opened[t].all_reduce(buf)
        return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3

    try:
        names = list(variants)
        for name in names:
            for _ in range(3):
                run(name)
        return run_rounds(names, run, [per_round] * rounds)
    finally:
        for tr in opened.values():
            tr.close()


def _round_figure(per_rank: list[dict], name: str, part) -> list[float]:
    """Per round: median over its steps of the slowest rank's `part(compute_ms, comm_ms)`."""
    rounds = zip(*(r[name] for r in per_rank), strict=True)
    return [
        statistics.median(max(part(*s) for s in step) for step in zip(*rnd, strict=True)) for rnd in rounds
    ]


def summarize(per_rank: list[dict], transports: list[str], bucket_bytes: list[int]) -> list[SyncCost]:
    buckets = len(bucket_bytes)
    med = statistics.median
    free = _round_figure(per_rank, "free", lambda c, _m: c)
    out = []
    for t in transports:
        step = _round_figure(per_rank, f"in-step:{t}", lambda c, m: c + m)
        tight = _round_figure(per_rank, f"tight:{t}", lambda _c, m: m)
        extra = [(s - f - k) / buckets for s, f, k in zip(step, free, tight, strict=True)]
        out.append(
            SyncCost(
                transport=t,
                world_size=len(per_rank),
                call_overhead_ms=max(0.0, med(extra)),
                free_compute_ms=med(free),
                in_step_ms=med(step),
                tight_comm_ms=med(tight),
                bucket_bytes=tuple(bucket_bytes),
            )
        )
    return out


def measure(
    model: str,
    per_worker_batch: int,
    bucket_bytes: list[int],
    world_size: int,
    *,
    transports: tuple[str, ...] = SYNC_TRANSPORTS,
    rounds: int | None = None,
    threads: int = 1,
    compute_ms: float = 1.0,
) -> list[SyncCost]:
    """The sync terms of `transports` for `model` at `world_size` (module docstring).

    `rounds` defaults to what fits about BUDGET_S given one step's `compute_ms`, within ROUNDS.
    """
    from dpscale.lab.multirank import run_ranks

    if world_size < 1:
        raise ConfigError(f"--co-located: must be >= 1, got {world_size}")
    if not bucket_bytes:
        raise ConfigError("sync: the model has no gradient buckets to reduce")
    per_round = steps_per_round(compute_ms)
    if rounds is None:
        per_round_s = (1 + len(transports)) * per_round * compute_ms / 1e3  # the computing variants
        rounds = min(max(int(BUDGET_S / per_round_s), ROUNDS[0]), ROUNDS[1])
    numels = [max(1, b // 4) for b in bucket_bytes]  # float32 buffers, as the engines' buckets
    per_rank = run_ranks(
        _rank_sync,
        world_size,
        model,
        per_worker_batch,
        numels,
        list(transports),
        rounds,
        per_round,
        threads=threads,
        timeout_s=300 + 30 * rounds,
    )
    return summarize(per_rank, list(transports), list(bucket_bytes))
