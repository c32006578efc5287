"""The machines a prediction is for: links inside and between nodes, workers per node, presets.

A cluster is two links (intra-node, inter-node), each a per-direction bandwidth and a per-step
latency, plus a fixed software overhead per collective call. Presets are nominal figures from
public specification sheets (docs/performance-model.md lists the document for each); the CPU
presets are figures measured on this project's 2-core development machine. `calibrated` replaces
the intra-node link by what `dpscale bench allreduce` measured, and keeps the measured all-reduce
times themselves for the world sizes that were measured (`MeasuredAllReduce`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..bench.report import read_report

INTRA, INTER = "intra-node", "inter-node"


@dataclass(frozen=True, kw_only=True)
class Link:
    name: str  # INTRA or INTER: what the bottleneck is called in words
    bandwidth_GBps: float  # per direction, 1e9 bytes/s (network links are quoted in Gbit/s: divide by 8)
    latency_us: float  # per sequential step of an algorithm (one message hop)

    def __post_init__(self) -> None:
        if not self.bandwidth_GBps > 0:
            raise ValueError(f"{self.name} bandwidth must be > 0 GB/s, got {self.bandwidth_GBps}")
        if not self.latency_us >= 0:
            raise ValueError(f"{self.name} latency must be >= 0 us, got {self.latency_us}")

    @property
    def bandwidth_Bps(self) -> float:
        return self.bandwidth_GBps * 1e9

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6


@dataclass(frozen=True)
class LinkPreset:
    bandwidth_GBps: float  # nominal, per direction
    latency_us: float  # per step, as a collective library sees it (see `source`)
    kind: str  # "intra" (inside a node), "inter" (between nodes) or "any"
    overhead_us: float  # fixed software cost per collective call of the library usually run on it
    source: str


# NCCL's tuning model (src/graph/tuning.cc, Simple protocol, ring) charges 3.4 us per NVLink step,
# 5.7 us per PCIe step, 9.6 us per network step and 8.4 us per call; those are used for GPU links.
_NCCL = "per-step latency and per-call overhead from NCCL's tuning model (src/graph/tuning.cc)"
_TCP = "latency: typical one-way kernel TCP small-message latency, assumed (no spec sheet gives it)"
_HERE = "measured on the dpscale development VM (2-core Xeon) with `dpscale bench allreduce`, 2 ranks"
LINK_PRESETS: dict[str, LinkPreset] = {
    "pcie3-x16": LinkPreset(15.75, 5.7, "intra", 8.4, f"PCI Express Base Specification 3.0; {_NCCL}"),
    "pcie4-x16": LinkPreset(31.5, 5.7, "intra", 8.4, f"PCI Express Base Specification 4.0; {_NCCL}"),
    "pcie5-x16": LinkPreset(63.0, 5.7, "intra", 8.4, f"PCI Express Base Specification 5.0; {_NCCL}"),
    "nvlink3": LinkPreset(300.0, 3.4, "intra", 8.4, f"NVIDIA A100 Tensor Core GPU datasheet; {_NCCL}"),
    "nvlink4": LinkPreset(450.0, 3.4, "intra", 8.4, f"NVIDIA H100 Tensor Core GPU datasheet; {_NCCL}"),
    "eth-10g": LinkPreset(1.25, 20.0, "inter", 8.4, f"IEEE 802.3ae (10 Gb/s); {_TCP}"),
    "eth-25g": LinkPreset(3.125, 20.0, "inter", 8.4, f"IEEE 802.3by (25 Gb/s); {_TCP}"),
    "eth-50g": LinkPreset(6.25, 20.0, "inter", 8.4, f"IEEE 802.3cd (50 Gb/s); {_TCP}"),
    "eth-100g": LinkPreset(12.5, 20.0, "inter", 8.4, f"IEEE 802.3ba (100 Gb/s); {_TCP}"),
    "eth-400g": LinkPreset(50.0, 20.0, "inter", 8.4, f"IEEE 802.3bs (400 Gb/s); {_TCP}"),
    "ib-hdr200": LinkPreset(25.0, 9.6, "inter", 8.4, f"NVIDIA ConnectX-6 VPI product brief (HDR); {_NCCL}"),
    "ib-ndr400": LinkPreset(50.0, 9.6, "inter", 8.4, f"NVIDIA ConnectX-7 product brief (NDR); {_NCCL}"),
    "cpu-shm": LinkPreset(3.5, 250.0, "intra", 10.0, f"dpscale shm transport, {_HERE}"),
    "cpu-loopback-gloo": LinkPreset(1.4, 58.0, "any", 13.0, f"gloo over loopback TCP, {_HERE}"),
}


@dataclass(frozen=True)
class ClusterPreset:
    intra: str  # a LINK_PRESETS name, optionally "Kx" (K links in parallel)
    inter: str
    workers_per_node: int
    source: str


CLUSTER_PRESETS: dict[str, ClusterPreset] = {
    "dgx-a100": ClusterPreset("nvlink3", "8xib-hdr200", 8, "NVIDIA DGX A100 System Architecture white paper"),
    "dgx-h100": ClusterPreset("nvlink4", "8xib-ndr400", 8, "NVIDIA DGX H100 datasheet"),
    "cpu-shm": ClusterPreset("cpu-shm", "cpu-loopback-gloo", 2, "this machine: shm within, gloo between"),
    "cpu-loopback-gloo": ClusterPreset("cpu-loopback-gloo", "cpu-loopback-gloo", 2, "this machine: gloo"),
}
# Defaults for a composed preset "INTRA+INTER": a typical server of that intra-node kind.
_DEFAULT_WORKERS_PER_NODE = {"nvlink3": 8, "nvlink4": 8, "cpu-shm": 2, "cpu-loopback-gloo": 2}
_MULTI_RE = re.compile(r"^(\d+)x([a-z0-9-]+)$")


@dataclass(frozen=True)
class MeasuredAllReduce:
    """All-reduce times one transport took at one world size, from `dpscale bench allreduce`."""

    transport: str
    world_size: int
    sizes_bytes: tuple[int, ...]  # ascending
    times_us: tuple[float, ...]
    alpha_us: float | None  # the bench's fit t = alpha + bytes/beta (None at world size 1)
    beta_GBps: float | None

    def time_us(self, nbytes: float) -> float:
        """Interpolated in log-log between measured sizes; beyond the largest, + bytes/beta."""
        xs, ts = self.sizes_bytes, self.times_us
        if nbytes <= xs[0]:
            return ts[0]
        if nbytes >= xs[-1]:
            extra = nbytes - xs[-1]
            if self.beta_GBps:
                return ts[-1] + extra / (self.beta_GBps * 1e3)
            return ts[-1] * nbytes / xs[-1]
        for k in range(1, len(xs)):
            if nbytes <= xs[k]:
                f = math.log(nbytes / xs[k - 1]) / math.log(xs[k] / xs[k - 1])
                return math.exp(math.log(ts[k - 1]) + f * math.log(ts[k] / ts[k - 1]))
        raise AssertionError("unreachable: nbytes is within the measured range")

    def latency_us(self) -> float:
        """The part of any call's time that does not depend on size."""
        return min(self.alpha_us if self.alpha_us is not None else self.times_us[0], self.times_us[0])


@dataclass(frozen=True)
class Layout:
    """How one world size sits on the cluster."""

    world_size: int
    nodes: int
    per_node: int


@dataclass(frozen=True, kw_only=True)
class Cluster:
    workers_per_node: int  # a world size fills nodes of this many workers
    intra: Link
    inter: Link
    per_message_overhead_us: float = 0.0  # fixed software cost per collective call
    name: str = "custom"
    source: str = ""  # where the figures come from, in words
    # world size -> measured all-reduce times (then the measurement is used, not the link model)
    measured: Mapping[int, MeasuredAllReduce] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.workers_per_node < 1:
            raise ValueError(f"--workers-per-node: must be >= 1, got {self.workers_per_node}")
        if self.per_message_overhead_us < 0:
            raise ValueError(f"--per-message-overhead-us: must be >= 0, got {self.per_message_overhead_us}")

    def layout(self, world_size: int) -> Layout:
        if world_size < 1:
            raise ValueError(f"--world-sizes: every world size must be >= 1, got {world_size}")
        g = self.workers_per_node
        if world_size <= g:
            return Layout(world_size, 1, world_size)
        if world_size % g:
            raise ValueError(
                f"--world-sizes: {world_size} does not fill nodes of {g} workers (--workers-per-node); "
                f"use a multiple of {g}"
            )
        return Layout(world_size, world_size // g, g)

    def describe(self) -> str:
        text = (
            f"{self.name}: {self.workers_per_node} workers/node; "
            f"intra-node {self.intra.bandwidth_GBps:g} GB/s, "
            f"{self.intra.latency_us:g} us/step; inter-node {self.inter.bandwidth_GBps * 8:g} Gbit/s, "
            f"{self.inter.latency_us:g} us/step; {self.per_message_overhead_us:g} us per call"
        )
        if self.measured:
            sizes = ", ".join(str(n) for n in sorted(self.measured))
            text += f"; measured all-reduce times at world sizes {sizes}"
        return text


def _link(spec: str, name: str, flag: str) -> tuple[Link, LinkPreset]:
    m = _MULTI_RE.match(spec)
    count, key = (int(m.group(1)), m.group(2)) if m else (1, spec)
    if key not in LINK_PRESETS or count < 1:
        raise ValueError(
            f"{flag}: unknown link {spec!r}; choose from {', '.join(LINK_PRESETS)} "
            "(optionally K links in parallel: 'Kx', e.g. 8xib-hdr200)"
        )
    p = LINK_PRESETS[key]
    return Link(name=name, bandwidth_GBps=count * p.bandwidth_GBps, latency_us=p.latency_us), p


def preset_cluster(spec: str, *, flag: str = "--preset") -> Cluster:
    """A cluster from a preset: a CLUSTER_PRESETS name, "INTRA+INTER" of LINK_PRESETS, or one link
    name (then used for both levels, one worker per node: e.g. one GPU per Ethernet host)."""
    if spec in CLUSTER_PRESETS:
        c = CLUSTER_PRESETS[spec]
        intra_spec, inter_spec, per_node, extra = c.intra, c.inter, c.workers_per_node, c.source
    elif "+" in spec:
        intra_spec, _, inter_spec = spec.partition("+")
        per_node, extra = _DEFAULT_WORKERS_PER_NODE.get(intra_spec, 4), ""
    else:
        if not _MULTI_RE.match(spec) and spec not in LINK_PRESETS:
            raise ValueError(
                f"{flag}: unknown preset {spec!r}; choose a cluster ({', '.join(CLUSTER_PRESETS)}), a link "
                f"({', '.join(LINK_PRESETS)}) or INTRA+INTER, e.g. pcie4-x16+4xeth-100g"
            )
        intra_spec = inter_spec = spec
        per_node, extra = 1, ""
    intra, intra_p = _link(intra_spec, INTRA, flag)
    inter, inter_p = _link(inter_spec, INTER, flag)
    sources = [s for s in (extra, intra_p.source, inter_p.source) if s]
    return Cluster(
        workers_per_node=per_node,
        intra=intra,
        inter=inter,
        per_message_overhead_us=intra_p.overhead_us,
        name=spec,
        source="; ".join(dict.fromkeys(sources)),
    )


def load_allreduce_report(report_dir: str | Path, *, flag: str = "--calibrate") -> dict:
    """The "results" of a `dpscale bench allreduce` report directory (or its report.json)."""
    results = read_report(report_dir, flag=flag)["results"]
    if not isinstance(results, dict) or "points" not in results or "fits" not in results:
        raise ValueError(f"{flag}: {report_dir} is not a `dpscale bench allreduce` report (no points/fits)")
    return results


def measured_allreduce(
    results: dict, transport: str, *, flag: str = "--calibrate"
) -> dict[int, MeasuredAllReduce]:
    """World size -> measured times of `transport` in an all-reduce report's results."""
    points = [p for p in results["points"] if p["transport"] == transport]
    if not points:
        have = sorted({p["transport"] for p in results["points"]})
        raise ValueError(f"{flag}: the report has no {transport!r} points; it measured {', '.join(have)}")
    fits = {f["world_size"]: f for f in results["fits"] if f["transport"] == transport}
    out = {}
    for n in sorted({p["world_size"] for p in points}):
        pts = sorted((p["bytes"], p["time_us"]) for p in points if p["world_size"] == n)
        # A larger message is never faster: a point above a larger one's time was hit by other load
        # on a shared machine (a burst can cover a whole point), so it is lowered to that time.
        times = [t for _, t in pts]
        for k in range(len(times) - 2, -1, -1):
            times[k] = min(times[k], times[k + 1])
        fit = fits.get(n, {})
        out[n] = MeasuredAllReduce(
            transport,
            n,
            tuple(b for b, _ in pts),
            tuple(times),
            fit.get("alpha_us"),
            fit.get("beta_GBps"),
        )
    return out


def calibrated(base: Cluster, results: dict, transport: str, *, flag: str = "--calibrate") -> Cluster:
    """`base` with the intra-node link fitted to `transport`'s measurements (and those kept).

    The link is derived from the largest measured world size n > 1 as if the transport ran a ring:
    latency per step = alpha / 2(n-1), bandwidth = busbw = beta * 2(n-1)/n. World sizes that were
    measured use the measured times directly (`Cluster.measured`).
    """
    measured = measured_allreduce(results, transport, flag=flag)
    # a call at world size 1 moves nothing: its time is the per-call software overhead
    overhead = measured[1].latency_us() if 1 in measured else base.per_message_overhead_us
    fitted = [m for n, m in measured.items() if n > 1 and m.alpha_us is not None and m.beta_GBps]
    intra = base.intra
    if fitted:
        m = max(fitted, key=lambda m: m.world_size)
        steps = 2 * (m.world_size - 1)
        intra = Link(
            name=INTRA,
            bandwidth_GBps=m.beta_GBps * steps / m.world_size,
            latency_us=max(m.alpha_us - overhead, 0.0) / steps,
        )
    return replace(
        base,
        intra=intra,
        per_message_overhead_us=overhead,
        name=f"{base.name}, calibrated: {transport}",
        source=f"intra-node link and per-call overhead fitted to `dpscale bench allreduce` ({transport})",
        measured=measured,
    )
