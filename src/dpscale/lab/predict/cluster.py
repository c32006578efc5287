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

from dpscale.errors import ConfigError
from dpscale.lab.bench.report import read_report

INTRA, INTER = "intra-node", "inter-node"


@dataclass(frozen=True, kw_only=True)
class Link:
    name: str  # INTRA or INTER: what the bottleneck is called in words
    bandwidth_GBps: float  # per direction, 1e9 bytes/s (network links are quoted in Gbit/s: divide by 8)
    latency_us: float  # per sequential step of an algorithm (one message hop)
    # achieved / nominal bandwidth of a collective on this link at large messages (presets: from
    # published nccl-tests results; 1 for measured links, whose figures are already achieved)
    efficiency: float = 1.0
    # >= 1: how much slower the fabric moves bytes for the job at hand (congestion, oversubscription);
    # set per world size by the model (degrade.py), 1 on a link at rest
    congestion: float = 1.0

    def __post_init__(self) -> None:
        if not self.bandwidth_GBps > 0:
            raise ConfigError(f"{self.name} bandwidth must be > 0 GB/s, got {self.bandwidth_GBps}")
        if not self.latency_us >= 0:
            raise ConfigError(f"{self.name} latency must be >= 0 us, got {self.latency_us}")
        if not 0 < self.efficiency <= 1:
            raise ConfigError(f"{self.name} efficiency must be in (0, 1], got {self.efficiency}")
        if not self.congestion >= 1:
            raise ConfigError(f"{self.name} congestion must be >= 1, got {self.congestion}")

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
    efficiency: float = 1.0  # achieved / nominal at large messages (see `source` and _EFFICIENCY)
    gpu: bool = True  # a GPU interconnect (a CPU profile on it draws a warning)
    # the GPUs' NVSwitch reduces in the switch (NVLink SHARP, "NVLS" in NCCL): see _NVLS below
    nvls: bool = False


# NCCL's tuning model (src/graph/tuning.cc, Simple protocol, ring) charges 3.4 us per NVLink step,
# 5.7 us per PCIe step, 9.6 us per network step and 8.4 us per call; those are used for GPU links.
_NCCL = "per-step latency and per-call overhead from NCCL's tuning model (src/graph/tuning.cc)"
_TCP = "latency: typical one-way kernel TCP small-message latency, assumed (no spec sheet gives it)"
_HERE = "measured on the dpscale development VM (2-core Xeon) with `dpscale bench allreduce`, 2 ranks"
# _EFFICIENCY: achieved fractions of nominal for an NCCL all-reduce at large messages (busbw / rate):
# NVLink: 200-208 GB/s busbw on 8 x A100 (NVLink3, 300 GB/s), nccl-tests issues #149 and #178;
# InfiniBand: 91 GB/s busbw over 4 x HDR (100 GB/s), nccl-tests issue #100 (84.8-96 GB/s in #119);
# PCIe: about 12 of 15.75 GB/s for gen3 x16 peer copies (assumed, no nccl-tests figure at hand);
# Ethernet (TCP or RoCE, as data-parallel frameworks drove it): fitted on the training half of the
# published cases (docs/performance-model.md, "Published results"), no first-hand source.
_NVLINK_EFF, _IB_EFF, _PCIE_EFF, ETH_EFFICIENCY = 0.69, 0.91, 0.76, 0.95
_EFF_SRC = "achieved fraction: see _EFFICIENCY in cluster.py"
# _NVLS: NVLink SHARP. Third-generation NVSwitch (H100/H200 SXM, NVLink 4) and the NVLink 5 switch
# (GB200 NVL) reduce in the switch (multimem loads and stores); NCCL 2.17+ uses it for all-reduce by
# default on them (the NCCL_NVLS_ENABLE and NCCL_ALGO=NVLS entries of NCCL's environment-variable
# documentation). Each GPU then sends and receives about n bytes instead of the ring's 2(g-1)/g n.
# The achieved fraction: S. Jeaugey (NVIDIA), nccl-tests issue #212: on 8 x H100 NVLS reaches "a
# peak busBw of ~480GB/s (algbw ~275GB/s)" of the 450 GB/s line rate, so algbw / rate = 275 / 450;
# nccl-tests issue #272 measured 475 GB/s busbw on 8 x H200. No source gives it for NVLink 5.
NVLS_EFFICIENCY = 275 / 450
NVLS_SOURCE = (
    "NVLink SHARP (in-switch reduction; NCCL's NVLS algorithm, NCCL environment-variable docs: "
    "NCCL_NVLS_ENABLE), achieved algbw 275 of 450 GB/s on 8 x H100 (nccl-tests issue #212)"
)
# SHARP on InfiniBand: NVIDIA Quantum switches reduce in the network (NCCL's CollNet, with the
# NCCL-SHARP plugin); a node sends its n bytes up once and receives the result once. Only presets
# whose source says the fabric has it carry it (ClusterPreset.sharp); --no-sharp switches it off.
SHARP_SOURCE = "SHARP in-network reduction on the InfiniBand fabric (NVIDIA Quantum switches; NCCL CollNet)"
# Step-to-step variation of a GPU's compute (per worker) and of the delay a node's host and network
# path add (per node, degrade.py) in the published systems: not published anywhere, fitted with
# ETH_EFFICIENCY on the training half of the published cases (the interference and congestion fitted
# there came out 0, so GPU presets carry none). Override with --compute-cv (or a profile), --node-cv.
GPU_COMPUTE_CV = 0.02
GPU_NODE_CV = 0.005


def _nv(bw: float, doc: str, nvls: bool = False) -> LinkPreset:
    return LinkPreset(bw, 3.4, "intra", 8.4, f"{doc}; {_NCCL}; {_EFF_SRC}", _NVLINK_EFF, nvls=nvls)


def _eth(bw: float, std: str, rdma: bool = False) -> LinkPreset:
    # RoCE: RDMA, the network latency of NCCL's model; kernel TCP: an assumed 20 us
    lat, how = (9.6, f"RoCE: {_NCCL}") if rdma else (20.0, _TCP)
    return LinkPreset(bw, lat, "inter", 8.4, f"{std}; {how}; {_EFF_SRC}", ETH_EFFICIENCY)


def _ib(bw: float, doc: str) -> LinkPreset:
    return LinkPreset(bw, 9.6, "inter", 8.4, f"{doc}; {_NCCL}; {_EFF_SRC}", _IB_EFF)


def _pcie(bw: float, spec: str) -> LinkPreset:
    return LinkPreset(bw, 5.7, "intra", 8.4, f"PCI Express Base Specification {spec}; {_NCCL}", _PCIE_EFF)


LINK_PRESETS: dict[str, LinkPreset] = {
    "pcie3-x16": _pcie(15.75, "3.0"),
    "pcie4-x16": _pcie(31.5, "4.0"),
    "pcie5-x16": _pcie(63.0, "5.0"),
    # NVLink per direction = the datasheet's total (both directions) / 2
    "nvlink1": _nv(80.0, "NVIDIA Tesla P100 white paper (4 NVLink 1 links x 20 GB/s per direction)"),
    "nvlink2": _nv(150.0, "NVIDIA Tesla V100 white paper (6 NVLink 2 links x 25 GB/s per direction)"),
    "nvlink3": _nv(300.0, "NVIDIA A100 Tensor Core GPU datasheet (NVLink 600 GB/s)"),
    # NVLink 4 and 5 as the SXM boards wire them, through NVSwitch (with NVLS, _NVLS above)
    "nvlink4": _nv(450.0, "NVIDIA H100 / H200 Tensor Core GPU datasheets (NVLink 900 GB/s)", nvls=True),
    "nvlink5": _nv(900.0, "NVIDIA Blackwell (B200) datasheet (NVLink 1.8 TB/s)", nvls=True),
    "eth-10g": _eth(1.25, "IEEE 802.3ae (10 Gb/s)"),
    "eth-25g": _eth(3.125, "IEEE 802.3by (25 Gb/s)"),
    "eth-50g": _eth(6.25, "IEEE 802.3cd (50 Gb/s)"),
    "eth-100g": _eth(12.5, "IEEE 802.3ba (100 Gb/s)"),
    "eth-200g": _eth(25.0, "IEEE 802.3bs (200 Gb/s)"),
    "eth-400g": _eth(50.0, "IEEE 802.3bs (400 Gb/s)"),
    "roce-25g": _eth(3.125, "IEEE 802.3by (25 Gb/s)", rdma=True),
    "roce-100g": _eth(12.5, "IEEE 802.3ba (100 Gb/s)", rdma=True),
    "roce-200g": _eth(25.0, "IEEE 802.3bs (200 Gb/s)", rdma=True),
    "roce-400g": _eth(50.0, "IEEE 802.3bs (400 Gb/s)", rdma=True),
    "ib-edr100": _ib(12.5, "NVIDIA (Mellanox) ConnectX-5 product brief (EDR 100 Gb/s)"),
    "ib-hdr200": _ib(25.0, "NVIDIA ConnectX-6 VPI product brief (HDR 200 Gb/s)"),
    "ib-ndr400": _ib(50.0, "NVIDIA ConnectX-7 product brief (NDR 400 Gb/s)"),
    "cpu-shm": LinkPreset(3.5, 250.0, "intra", 10.0, f"dpscale shm transport, {_HERE}", gpu=False),
    "cpu-loopback-gloo": LinkPreset(1.4, 58.0, "any", 13.0, f"gloo over loopback TCP, {_HERE}", gpu=False),
}


@dataclass(frozen=True)
class ClusterPreset:
    intra: str  # a LINK_PRESETS name, optionally "Kx" (K links in parallel)
    inter: str
    workers_per_node: int
    source: str
    sharp: bool = False  # the source says the inter-node fabric reduces in the network (SHARP)


CLUSTER_PRESETS: dict[str, ClusterPreset] = {
    "dgx-1v": ClusterPreset("nvlink2", "4xib-edr100", 8, "NVIDIA DGX-1 with Tesla V100 System Architecture"),
    "dgx-2h": ClusterPreset("nvlink2", "8xib-edr100", 16, "NVIDIA DGX-2H datasheet (NVSwitch, 8 x EDR)"),
    "dgx-a100": ClusterPreset("nvlink3", "8xib-hdr200", 8, "NVIDIA DGX A100 System Architecture white paper"),
    "dgx-h100": ClusterPreset("nvlink4", "8xib-ndr400", 8, "NVIDIA DGX H100 datasheet"),
    "dgx-h200": ClusterPreset(
        "nvlink4", "8xib-ndr400", 8, "NVIDIA DGX H200 datasheet (8 x ConnectX-7 400 Gb/s)"
    ),
    "hgx-h100-roce400": ClusterPreset(
        "nvlink4", "8xroce-400g", 8, "NVIDIA HGX H100 with 8 x 400GbE RoCE NICs"
    ),
    "dgx-h100-superpod": ClusterPreset(
        "nvlink4",
        "8xib-ndr400",
        8,
        "NVIDIA DGX SuperPOD reference architecture with DGX H100 (RA-11333-001; docs.nvidia.com/"
        "dgx-superpod/reference-architecture-scalable-infrastructure-h100): compute fabric of "
        "NDR 400 Gb/s Quantum-2 InfiniBand switches with SHARP in-network computing",
        sharp=True,
    ),
    # one NVLink domain of 72 GPUs is one "node" here (the model's intra-node level)
    "gb200-nvl72": ClusterPreset(
        "nvlink5",
        "72xib-ndr400",
        72,
        "NVIDIA GB200 NVL72 (72 Blackwell GPUs in one NVLink 5 domain); one 400 Gb/s NIC per GPU "
        "between domains assumed",
    ),
    "cpu-shm": ClusterPreset("cpu-shm", "cpu-loopback-gloo", 2, "this machine: shm within, gloo between"),
    "cpu-loopback-gloo": ClusterPreset("cpu-loopback-gloo", "cpu-loopback-gloo", 2, "this machine: gloo"),
}
# Defaults for a composed preset "INTRA+INTER": a typical server of that intra-node kind.
_DEFAULT_WORKERS_PER_NODE = {f"nvlink{k}": 8 for k in range(1, 6)} | {"cpu-shm": 2, "cpu-loopback-gloo": 2}
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


def size_factor(points: tuple[tuple[int, float], ...], nbytes: float) -> float:
    """The factor at `nbytes`, log-log interpolated between sizes; the end ones beyond them."""
    if nbytes <= points[0][0]:
        return points[0][1]
    for (x0, f0), (x1, f1) in zip(points, points[1:], strict=False):
        if nbytes <= x1:
            t = math.log(nbytes / x0) / math.log(x1 / x0)
            return math.exp(math.log(f0) + t * math.log(f1 / f0))
    return points[-1][1]


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
    gpu: bool = False  # its links are GPU interconnects (a CPU profile on it draws a warning)
    # links move bytes at their achieved fraction of nominal (Link.efficiency); False: nominal
    achieved_bandwidth: bool = True
    # the at-scale terms the fabric and devices carry (degrade.py); the CLI flags override them
    congestion_per_doubling: float = 0.0  # inter-node bandwidth lost per doubling of the nodes
    interference: float = 0.0  # backward slowdown per ms of communication it hides
    # step-to-step variation (std / mean) of its devices' compute, used when neither the profile nor
    # --compute-cv gives one (GPU presets: GPU_COMPUTE_CV)
    compute_cv: float = 0.0
    # the same for the delay a node's host and network path add to all its workers (GPU presets:
    # GPU_NODE_CV), used unless --node-cv gives one
    node_cv: float = 0.0
    # samples/s its hosts' input pipeline delivers per node (degrade.py); None: unlimited (no preset
    # carries one: no source at hand publishes a host's decode rate)
    input_samples_per_s: float | None = None
    # level (INTRA, INTER) -> ((message bytes, measured / modelled time), ...) at the world size a
    # measured all-reduce calibrated that level's link (fabric_fit.py): how far the achieved rate
    # falls short of the fitted link at each size; other world sizes take the same factor by size
    size_factors: Mapping[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    # the intra-node switch reduces in the switch (NVLS, _NVLS above): costs.py offers the nvls algorithm
    nvls: bool = False
    # the inter-node fabric reduces in the network (SHARP): the inter-node phase moves n once per node
    sharp: bool = False

    def __post_init__(self) -> None:
        if self.workers_per_node < 1:
            raise ConfigError(f"--workers-per-node: must be >= 1, got {self.workers_per_node}")
        if self.per_message_overhead_us < 0:
            raise ConfigError(f"--per-message-overhead-us: must be >= 0, got {self.per_message_overhead_us}")

    def layout(self, world_size: int) -> Layout:
        if world_size < 1:
            raise ConfigError(f"--world-sizes: every world size must be >= 1, got {world_size}")
        g = self.workers_per_node
        if world_size <= g:
            return Layout(world_size, 1, world_size)
        if world_size % g:
            raise ConfigError(
                f"--world-sizes: {world_size} does not fill nodes of {g} workers (--workers-per-node); "
                f"use a multiple of {g}"
            )
        return Layout(world_size, world_size // g, g)

    def describe(self) -> str:
        def achieved(link: Link) -> str:
            return (
                f" (achieved {link.efficiency:.0%})"
                if link.efficiency < 1 and self.achieved_bandwidth
                else ""
            )

        reduce_in = [w for w, on in (("NVLink SHARP", self.nvls), ("InfiniBand SHARP", self.sharp)) if on]
        text = (
            f"{self.name}: {self.workers_per_node} workers/node; "
            f"intra-node {self.intra.bandwidth_GBps:g} GB/s{achieved(self.intra)}, "
            f"{self.intra.latency_us:g} us/step; inter-node {self.inter.bandwidth_GBps * 8:g} Gbit/s"
            f"{achieved(self.inter)}, "
            f"{self.inter.latency_us:g} us/step; {self.per_message_overhead_us:g} us per call"
        )
        if reduce_in:
            text += f"; in-switch reduction: {', '.join(reduce_in)}"
        if self.measured:
            sizes = ", ".join(str(n) for n in sorted(self.measured))
            text += f"; measured all-reduce times at world sizes {sizes}"
        return text


def _link(spec: str, name: str, flag: str) -> tuple[Link, LinkPreset]:
    m = _MULTI_RE.match(spec)
    count, key = (int(m.group(1)), m.group(2)) if m else (1, spec)
    if key not in LINK_PRESETS or count < 1:
        raise ConfigError(
            f"{flag}: unknown link {spec!r}; choose from {', '.join(LINK_PRESETS)} "
            "(optionally K links in parallel: 'Kx', e.g. 8xib-hdr200)"
        )
    p = LINK_PRESETS[key]
    link = Link(
        name=name, bandwidth_GBps=count * p.bandwidth_GBps, latency_us=p.latency_us, efficiency=p.efficiency
    )
    return link, p


def preset_cluster(spec: str, *, flag: str = "--preset") -> Cluster:
    """A cluster from a preset: a CLUSTER_PRESETS name, "INTRA+INTER" of LINK_PRESETS, or one link
    name (then used for both levels, one worker per node: e.g. one GPU per Ethernet host)."""
    if spec in CLUSTER_PRESETS:
        c = CLUSTER_PRESETS[spec]
        intra_spec, inter_spec, per_node, extra = c.intra, c.inter, c.workers_per_node, c.source
        sharp = c.sharp
    elif "+" in spec:
        sharp = False
        intra_spec, _, inter_spec = spec.partition("+")
        per_node, extra = _DEFAULT_WORKERS_PER_NODE.get(intra_spec, 4), ""
    else:
        if not _MULTI_RE.match(spec) and spec not in LINK_PRESETS:
            raise ConfigError(
                f"{flag}: unknown preset {spec!r}; choose a cluster ({', '.join(CLUSTER_PRESETS)}), a link "
                f"({', '.join(LINK_PRESETS)}) or INTRA+INTER, e.g. pcie4-x16+4xeth-100g"
            )
        intra_spec = inter_spec = spec
        per_node, extra, sharp = 1, "", False
    intra, intra_p = _link(intra_spec, INTRA, flag)
    inter, inter_p = _link(inter_spec, INTER, flag)
    nvls = intra_p.nvls
    sources = [s for s in (extra, intra_p.source, inter_p.source) if s]
    sources += [s for s, on in ((NVLS_SOURCE, nvls), (SHARP_SOURCE, sharp)) if on]
    return Cluster(
        workers_per_node=per_node,
        intra=intra,
        inter=inter,
        per_message_overhead_us=intra_p.overhead_us,
        name=spec,
        source="; ".join(dict.fromkeys(sources)),
        gpu=intra_p.gpu or inter_p.gpu,
        compute_cv=GPU_COMPUTE_CV if intra_p.gpu else 0.0,
        node_cv=GPU_NODE_CV if intra_p.gpu else 0.0,
        nvls=nvls,
        sharp=sharp,
    )


def load_allreduce_report(report_dir: str | Path, *, flag: str = "--calibrate") -> dict:
    """The "results" of a `dpscale bench allreduce` report directory (or its report.json)."""
    results = read_report(report_dir, flag=flag)["results"]
    if not isinstance(results, dict) or "points" not in results or "fits" not in results:
        raise ConfigError(f"{flag}: {report_dir} is not a `dpscale bench allreduce` report (no points/fits)")
    return results


def measured_allreduce(
    results: dict, transport: str, *, flag: str = "--calibrate"
) -> dict[int, MeasuredAllReduce]:
    """World size -> measured times of `transport` in an all-reduce report's results."""
    points = [p for p in results["points"] if p["transport"] == transport]
    if not points:
        have = sorted({p["transport"] for p in results["points"]})
        raise ConfigError(f"{flag}: the report has no {transport!r} points; it measured {', '.join(have)}")
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
        assert m.alpha_us is not None and m.beta_GBps is not None  # fitted ones only
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
