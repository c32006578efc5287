"""All-reduce bench (`dpscale bench allreduce`): time vs message size per transport and world size.

Modelled on nccl-tests' all_reduce_perf, on CPU ranks: for every (transport, world size, size) a
float32 tensor of size/4 elements is summed in place. Each iteration is timed on every rank with no
barrier in the loop; an iteration's time is the slowest rank's (what the next collective waits
for), and a point's time is the median over iterations. Before timing, each point is checked once
(rank r contributes r+1 everywhere; the sum must be n(n+1)/2), so a broken transport fails loudly
instead of reporting fast times.

Figures (GB/s = 1e9 bytes/s, sizes binary):
    algbw_GBps = bytes / time
    busbw_GBps = algbw * 2(n-1)/n   (nccl-tests' all-reduce convention; 0 for n = 1)
and per (transport, n > 1) a latency-bandwidth fit t = alpha + bytes/beta.

JSON (`AllReduceResult.to_dict()`; the `--json` line is the "points" list alone):
    {"config": {"transports": [str], "world_sizes": [int], "sizes_bytes": [int], "iters": int | null},
     "points": [{"transport": str, "world_size": int, "bytes": int, "time_us": float,
                 "algbw_GBps": float, "busbw_GBps": float,
                 "time_us_p10": float | null, "time_us_p90": float | null}, ...],
     "fits": [{"transport": str, "world_size": int, "alpha_us": float, "beta_GBps": float | null,
               "points": int, "rms_rel_error": float}, ...]}
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dpscale.errors import ConfigError
from dpscale.flags import flag_spec, unchecked_config
from dpscale.lab.bench.args import nproc_list_field, parse_name_list, parse_size_list
from dpscale.lab.bench.rounds import quantile
from dpscale.lab.bench.transports import TRANSPORTS, RankTransport, TransportSpec
from dpscale.lab.multirank import run_ranks
from dpscale.log import get_logger

logger = get_logger(__name__)

DEFAULT_SIZES_BYTES = [4 * 4**k for k in range(13)]  # 4 B, 16 B, ..., 64 MiB
BUSBW_CONVENTION = (
    "busbw = algbw * 2(n-1)/n (nccl-tests all-reduce convention: the traffic each link of a ring "
    "carries); 0 for world size 1, where nothing crosses a link"
)
WARMUP_ITERS = 3
# Adaptive iteration count: enough for a stable median, short enough for a 13-size sweep.
TARGET_POINT_S = 0.3
MIN_ITERS, MAX_ITERS = 5, 200
# bounds on what one may ask for, so that a bench ends in a time stated up front: --iters 1e12 ran
# forever, and a message is allocated on every rank (plus a copy), so a terabyte one exhausts memory
MAX_GIVEN_ITERS = 10_000
MAX_SIZE_BYTES = 1 << 30


# ---- config and results -------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class AllReduceConfig:
    transports: list[str] = field(
        default_factory=lambda: ["gloo"],
        metadata=flag_spec(
            name="--transport",
            parse=lambda s: parse_name_list(s, flag="--transport"),
            help="comma-separated (default: every transport available here) from "
            + "; ".join(f"{name}: {spec.description}" for name, spec in TRANSPORTS.items()),
        ),
    )
    """Transports to sweep, names in TRANSPORTS (the API's default: gloo)."""
    world_sizes: list[int] = nproc_list_field()
    """Comma-separated rank counts, one sweep each."""
    sizes_bytes: list[int] = field(
        default_factory=lambda: list(DEFAULT_SIZES_BYTES),
        metadata=flag_spec(
            name="--sizes",
            parse=lambda s: parse_size_list(s, flag="--sizes"),
            help="comma-separated message sizes, binary K/M/G, each rounded down to whole float32 "
            "elements (default 4,16,64,...,64M)",
        ),
    )
    """Message sizes in bytes."""
    iters: int | None = None
    """Timed iterations per point (default: adaptive, about 0.3 s a point)."""

    def __post_init__(self) -> None:
        lists: tuple[tuple[str, list[Any]], ...] = (
            ("--transport", self.transports),
            ("--nproc", self.world_sizes),
        )
        for flag, values in lists:
            if not values:
                raise ConfigError(f"{flag}: the list is empty; give at least one value")
            dupes = sorted({v for v in values if values.count(v) > 1})
            if dupes:
                raise ConfigError(f"{flag}: {', '.join(map(str, dupes))} listed more than once")
        parse_name_list(",".join(self.transports), flag="--transport", choices=list(TRANSPORTS))
        if any(n < 1 for n in self.world_sizes):
            raise ConfigError(f"--nproc: every world size must be >= 1, got {self.world_sizes}")
        for t in self.transports:
            for n in self.world_sizes:
                if why := TRANSPORTS[t].unavailable(n):
                    raise ConfigError(f"--transport: {t} cannot run at world size {n}: {why}")
        if not self.sizes_bytes or any(s < 1 for s in self.sizes_bytes):
            raise ConfigError(f"--sizes: give at least one size, each >= 1 byte; got {self.sizes_bytes}")
        if self.iters is not None and not 1 <= self.iters <= MAX_GIVEN_ITERS:
            raise ConfigError(
                f"--iters: must be between 1 and {MAX_GIVEN_ITERS:,} (a point of {MAX_GIVEN_ITERS:,} "
                f"iterations of 1 ms takes 10 s), or omitted for adaptive (about {TARGET_POINT_S} s a "
                f"point); got {self.iters}"
            )
        if max(self.sizes_bytes) > MAX_SIZE_BYTES:
            raise ConfigError(
                f"--sizes: {max(self.sizes_bytes):,} bytes is more than the {MAX_SIZE_BYTES >> 30} GiB "
                "a message may be (each rank holds it twice); give smaller sizes"
            )

    def message_numels(self) -> list[int]:
        """float32 element counts to sweep, ascending; sizes that round alike are measured once."""
        return sorted({max(1, s // 4) for s in self.sizes_bytes})


@dataclass(frozen=True)
class AllReducePoint:
    transport: str
    world_size: int
    bytes: int  # bytes reduced per rank (whole float32 elements)
    time_us: float  # median over iterations of the slowest rank's time
    algbw_GBps: float
    busbw_GBps: float
    # p10 / p90 over iterations of the same; last, with defaults: older reports' points lack them
    time_us_p10: float | None = None
    time_us_p90: float | None = None

    @classmethod
    def from_time(
        cls,
        transport: str,
        world_size: int,
        num_bytes: int,
        time_us: float,
        p10_us: float | None = None,
        p90_us: float | None = None,
    ) -> AllReducePoint:
        algbw = num_bytes / (time_us * 1e-6) / 1e9
        busbw = algbw * 2 * (world_size - 1) / world_size
        return cls(transport, world_size, num_bytes, time_us, algbw, busbw, p10_us, p90_us)

    @property
    def spread(self) -> float | None:
        """(p90 - p10) / median of the time per all-reduce."""
        if self.time_us_p10 is None or self.time_us_p90 is None or not self.time_us > 0:
            return None
        return (self.time_us_p90 - self.time_us_p10) / self.time_us

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LatencyBandwidthFit:
    transport: str
    world_size: int
    alpha_us: float  # fixed cost per call
    beta_GBps: float | None  # asymptotic algbw; None when time does not grow with size
    points: int
    rms_rel_error: float  # how well t = alpha + bytes/beta describes the points

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class AllReduceResult:
    config: AllReduceConfig
    points: list[AllReducePoint]
    fits: list[LatencyBandwidthFit]

    def to_dict(self) -> dict:
        return {
            "config": asdict(self.config),
            "points": [p.to_dict() for p in self.points],
            "fits": [f.to_dict() for f in self.fits],
        }

    @classmethod
    def from_dict(cls, doc: dict) -> AllReduceResult:
        """Rebuild from `to_dict()` output (report.json's "results"), e.g. to re-render a report."""
        config = unchecked_config(AllReduceConfig, doc["config"])  # its transports need not exist now
        points = [AllReducePoint(**p) for p in doc["points"]]
        return cls(config, points, [LatencyBandwidthFit(**f) for f in doc["fits"]])


class TransportCheckError(RuntimeError):
    """A transport returned a wrong sum; its timings would be meaningless."""


# ---- measurement (inside the ranks) -------------------------------------------------------------


def _timed_s(all_reduce: Callable[[torch.Tensor], None], tensor: torch.Tensor) -> float:
    t0 = time.perf_counter()
    all_reduce(tensor)
    return time.perf_counter() - t0


def _check(transport: RankTransport, tensor: torch.Tensor, rank: int, world_size: int) -> str | None:
    tensor.fill_(float(rank + 1))
    transport.all_reduce(tensor)
    expected = world_size * (world_size + 1) / 2  # small integers: exact in float32
    if bool((tensor == expected).all()):
        return None
    lo, hi = tensor.min().item(), tensor.max().item()
    return f"rank {rank}: expected every element to be {expected:g}, got values in [{lo:g}, {hi:g}]"


def _time_point(transport: RankTransport, tensor: torch.Tensor, iters: int | None) -> list[float]:
    # Zeros: repeated in-place sums of anything else grow n-fold per call and reach inf (or pass
    # through denormals, which are slow on CPU) within a long run.
    tensor.zero_()
    warm = [_timed_s(transport.all_reduce, tensor) for _ in range(WARMUP_ITERS)]
    if iters is None:
        # Every rank must run the same number of collectives: agree on the slowest estimate.
        estimate = torch.tensor([statistics.median(warm)], dtype=torch.float64)
        dist.all_reduce(estimate, op=dist.ReduceOp.MAX)
        iters = min(MAX_ITERS, max(MIN_ITERS, math.ceil(TARGET_POINT_S / max(estimate.item(), 1e-9))))
    return [_timed_s(transport.all_reduce, tensor) for _ in range(iters)]


def _rank_sweep(
    rank: int, world_size: int, specs: dict[str, TransportSpec], numels: list[int], iters: int | None
) -> dict:
    times: dict[str, dict[int, list[float]]] = {}
    for name, spec in specs.items():
        transport = spec.setup(rank, world_size)
        try:
            times[name] = {}
            for numel in numels:
                tensor = transport.buffer(numel)
                error = _check(transport, tensor, rank, world_size)
                # Agree over the harness's gloo group so that all ranks stop together, rather than
                # the healthy ones hanging in the next collective.
                bad = torch.tensor([error is not None], dtype=torch.int32)
                dist.all_reduce(bad)
                if bad.item():
                    where = f"transport {name!r}, world size {world_size}, {numel * 4} bytes"
                    return {"failed": True, "error": f"{where}: {error}" if error else None}
                times[name][numel] = _time_point(transport, tensor, iters)
        finally:
            transport.close()
    return {"failed": False, "times": times}


# ---- orchestration ------------------------------------------------------------------------------


def run(config: AllReduceConfig) -> AllReduceResult:
    """Measure every (transport, world size, size) of `config`; one set of ranks per world size."""
    specs = {name: TRANSPORTS[name] for name in config.transports}
    numels = config.message_numels()
    cores = os.cpu_count() or 1
    points = []
    for world_size in config.world_sizes:
        if world_size > cores:
            logger.warning(
                "world size %d > %d logical cores; ranks time-share cores, so the figures measure the "
                "scheduler as much as the transport",
                world_size,
                cores,
            )
        # Generous: a hang still ends (with every rank's stack), a slow shared machine does not.
        timeout_s = 120 + len(numels) * len(specs) * (30 + 2 * (config.iters or 0))
        per_rank = run_ranks(_rank_sweep, world_size, specs, numels, config.iters, timeout_s=timeout_s)
        if any(r["failed"] for r in per_rank):
            errors = "; ".join(r["error"] for r in per_rank if r.get("error"))
            raise TransportCheckError(f"all-reduce returned a wrong sum: {errors}")
        for name in config.transports:
            for numel in numels:
                per_iter_s = [
                    max(ts) for ts in zip(*(r["times"][name][numel] for r in per_rank), strict=True)
                ]
                time_us = statistics.median(per_iter_s) * 1e6
                p10, p90 = (quantile(per_iter_s, q) * 1e6 for q in (0.1, 0.9))
                points.append(AllReducePoint.from_time(name, world_size, numel * 4, time_us, p10, p90))
    return AllReduceResult(config, points, fit_all(points))


def fit_latency_bandwidth(
    sizes_bytes: Sequence[int], times_us: Sequence[float]
) -> tuple[float, float | None, float]:
    """Least-squares fit of t = alpha + bytes/beta; returns (alpha_us, beta_GBps or None, rms_rel_error).

    Residuals are relative (each row divided by its t): plain least squares would let the largest
    messages' absolute noise, which is bigger than alpha itself, decide the latency.
    """
    b, t = np.asarray(sizes_bytes, dtype=np.float64), np.asarray(times_us, dtype=np.float64)
    if len(b) < 2 or len(set(b.tolist())) < 2:
        raise ConfigError("a latency-bandwidth fit needs points at two or more different sizes")
    design = np.column_stack([np.ones_like(b), b]) / t[:, None]
    (alpha_us, us_per_byte), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    rms = float(np.sqrt(np.mean(((alpha_us + b * us_per_byte - t) / t) ** 2)))
    # No bandwidth term when it adds (next to) nothing even at the largest size: a flat or falling
    # curve, where 1/slope would be a huge or negative number from rounding error.
    grows = us_per_byte * b.max() > 1e-6 * t.max()
    beta_GBps = float(1e-3 / us_per_byte) if grows else None  # bytes/us -> GB/s: * 1e6 / 1e9
    return float(alpha_us), beta_GBps, rms


def _series(points: Sequence[AllReducePoint]) -> dict[tuple[str, int], list[AllReducePoint]]:
    series: dict[tuple[str, int], list[AllReducePoint]] = {}
    for p in points:
        series.setdefault((p.transport, p.world_size), []).append(p)
    return series


def fit_all(points: Sequence[AllReducePoint]) -> list[LatencyBandwidthFit]:
    """One fit per (transport, world size > 1) with two or more sizes; world size 1 moves no data."""
    fits = []
    for (transport, n), group in _series(points).items():
        if n > 1 and len({p.bytes for p in group}) >= 2:
            alpha, beta, rms = fit_latency_bandwidth([p.bytes for p in group], [p.time_us for p in group])
            fits.append(LatencyBandwidthFit(transport, n, alpha, beta, len(group), rms))
    return fits
