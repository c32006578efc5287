"""A cluster calibrated from all-reduce times the user measured (`dpscale predict --calibrate-from`).

Each measurement is one world size's all-reduce time per message size: an nccl-tests
`all_reduce_perf` table (nccl_tests.py) or a `dpscale bench allreduce` report. Two things follow:

- at a measured world size the measured times are used as they are (`Cluster.measured`: log-log
  interpolation between sizes, so the achieved bandwidth is a function of size and N there);
- for other world sizes the preset's nominal links are replaced: a one-node measurement sets the
  intra-node link, a multi-node one the inter-node link, each fitted so that the model (costs.py,
  the algorithm it would pick) gives the measured time at the largest size (bandwidth) and at the
  smallest (per-step latency). The fitted links carry achieved figures (efficiency 1). Between
  those ends the measured time / the fitted link's time at each measured size (mid sizes: several
  times, where NCCL changes protocol and a two-parameter link cannot follow) is kept
  (`Cluster.size_factors`) and applied to that level's all-reduces at other world sizes by size.

Several files (one per node count) calibrate both levels; the largest world size of each level
sets its link.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from dpscale.errors import ConfigError
from dpscale.lab.predict.cluster import (
    INTER,
    INTRA,
    Cluster,
    MeasuredAllReduce,
    load_allreduce_report,
    measured_allreduce,
)
from dpscale.lab.predict.costs import all_reduce_cost
from dpscale.lab.predict.nccl_tests import FLAG, NcclTable, read_table

NCCL_TESTS = "nccl-tests"
_BISECT_STEPS = 32
# a fitted link that still misses the measured time by more than this cannot be fitted: the other
# level's link alone is slower than the measurement
FIT_TOLERANCE = 0.02


@dataclass(frozen=True)
class Measurement:
    """One world size's measured all-reduce times, and how many nodes it spanned."""

    source: str  # the file, in words
    nodes: int
    times: MeasuredAllReduce


def monotone(times: Sequence[float]) -> tuple[float, ...]:
    """A larger message is never faster: a time above a larger one's was hit by other load (one
    burst can cover a point), so it is lowered to that time (as measured_allreduce does)."""
    out = list(times)
    for k in range(len(out) - 2, -1, -1):
        out[k] = min(out[k], out[k + 1])
    return tuple(out)


def from_table(table: NcclTable) -> Measurement:
    sizes, times = table.sizes_bytes, monotone(table.time_us)
    beta = None
    if len(sizes) > 1 and times[-1] > times[-2]:
        # beyond the largest size: the rate of the last step, bytes per us -> GB/s
        beta = (sizes[-1] - sizes[-2]) / (times[-1] - times[-2]) / 1e3
    measured = MeasuredAllReduce(NCCL_TESTS, table.world_size, sizes, times, times[0], beta)
    return Measurement(
        f"{table.path} ({table.world_size} GPUs on {table.nodes} node(s))", table.nodes, measured
    )


def read_measurements(paths: Sequence[str], *, transport: str | None = None) -> list[Measurement]:
    """Every file's measurement, all checked before any is used: an nccl-tests output file, or a
    `dpscale bench allreduce` report (a directory or its report.json; one node, `transport`'s points)."""
    if not paths:
        raise ConfigError(f"{FLAG}: give one or more files")
    out: list[Measurement] = []
    for name in paths:
        path = Path(name)
        if path.is_dir() or path.suffix == ".json":
            results = load_allreduce_report(path, flag=FLAG)
            have = list(dict.fromkeys(p["transport"] for p in results["points"]))
            chosen = transport or ("shm" if "shm" in have else have[0])
            for n, m in measured_allreduce(results, chosen, flag=FLAG).items():
                if n > 1:
                    out.append(Measurement(f"{path} ({chosen}, {n} workers)", 1, m))
        else:
            out.append(from_table(read_table(path)))
    sizes = [m.times.world_size for m in out]
    if len(set(sizes)) != len(sizes):
        raise ConfigError(f"{FLAG}: two measurements of the same world size ({sizes}); give one per size")
    return out


def _solve(f: Callable[[float], float], target: float, lo: float, hi: float, increasing: bool) -> float:
    """x in [lo, hi] with f(x) = target for a monotone f (geometric bisection); an end if out of range."""
    for _ in range(_BISECT_STEPS):
        mid = (lo * hi) ** 0.5
        above = f(mid) > target
        if above == increasing:
            hi = mid
        else:
            lo = mid
    return (lo * hi) ** 0.5


def _fit_link(cluster: Cluster, m: MeasuredAllReduce, level: str) -> Cluster:
    """`cluster` with the `level` link's bandwidth and latency fitted to `m` (at its world size)."""
    n = m.world_size
    plain = replace(cluster, measured={}, size_factors={})

    def with_link(bandwidth: float, latency: float) -> Cluster:
        attr = "intra" if level == INTRA else "inter"
        link = replace(getattr(plain, attr), bandwidth_GBps=bandwidth, latency_us=latency, efficiency=1.0)
        return replace(plain, **{attr: link})

    def seconds(c: Cluster, nbytes: int) -> float:
        return all_reduce_cost(nbytes, n, c, "auto").seconds

    link = plain.intra if level == INTRA else plain.inter
    bandwidth, latency = link.bandwidth_GBps, link.latency_us
    big, small = m.sizes_bytes[-1], m.sizes_bytes[0]
    t_big, t_small = m.times_us[-1] * 1e-6, m.times_us[0] * 1e-6

    def at_big(b: float) -> float:  # reads `latency` as it is when called: the last one fitted
        return seconds(with_link(b, latency), big)

    def at_small(a: float) -> float:
        return seconds(with_link(bandwidth, a), small)

    for _ in range(2):  # each fit moves the other a little: a second round settles both
        bandwidth = _solve(at_big, t_big, 1e-3, 1e5, increasing=False)
        if len(m.sizes_bytes) > 1 and small < big:
            latency = _solve(at_small, t_small, 1e-3, 1e5, increasing=True)
    fitted = with_link(bandwidth, latency)
    if abs(seconds(fitted, big) / t_big - 1) > FIT_TOLERANCE:
        other = "intra" if level == INTER else "inter"
        raise ConfigError(
            f"{FLAG}: no {level} rate reproduces {n} workers' measured {m.times_us[-1]:g} us at "
            f"{big:,} bytes with this preset's {other}-node link ({cluster.name}); give a file that "
            f"calibrates that link too (one per node count) or the preset of the machine measured"
        )
    # what the measurement falls short of (or beats) the fitted link by at each size: protocol
    # changes and pipelining a two-parameter link cannot follow; carried to other N by size
    factors = tuple(
        (s, t * 1e-6 / seconds(fitted, s)) for s, t in zip(m.sizes_bytes, m.times_us, strict=True)
    )
    return replace(fitted, size_factors={**cluster.size_factors, level: factors})


def calibrated_from(base: Cluster, measurements: Sequence[Measurement]) -> Cluster:
    """`base` with its links fitted to the measurements and the measured times kept (module doc)."""
    cluster = base
    multi = [m for m in measurements if m.nodes > 1]
    if multi:
        per_node = {m.times.world_size // m.nodes for m in multi}
        if len(per_node) > 1:
            raise ConfigError(
                f"{FLAG}: the multi-node files have different GPUs per node ({sorted(per_node)})"
            )
        cluster = replace(cluster, workers_per_node=per_node.pop())
    one = [m for m in measurements if m.nodes == 1]
    if one:
        cluster = _fit_link(cluster, max(one, key=lambda m: m.times.world_size).times, INTRA)
    if multi:
        cluster = _fit_link(cluster, max(multi, key=lambda m: m.times.world_size).times, INTER)
    for m in one:
        if m.times.world_size > cluster.workers_per_node:
            raise ConfigError(
                f"{FLAG}: {m.source} ran {m.times.world_size} GPUs on one node, more than the "
                f"{cluster.workers_per_node} per node of the cluster; give --workers-per-node"
            )
    fitted = [lvl for lvl, ms in ((INTRA, one), (INTER, multi)) if ms]
    return replace(
        cluster,
        measured={m.times.world_size: m.times for m in measurements},
        name=f"{base.name}, calibrated from measured all-reduce times",
        source=(
            f"{' and '.join(fitted)} link(s) fitted to measured all-reduce times: "
            + "; ".join(m.source for m in measurements)
            + (f"; the rest: {base.source}" if base.source else "")
        ),
        achieved_bandwidth=cluster.achieved_bandwidth,
    )
