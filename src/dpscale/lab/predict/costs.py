"""Latency-bandwidth (alpha-beta) cost of one all-reduce of n bytes over p workers, per algorithm.

Every algorithm is written as a sum of terms: latency (sequential steps x a link's per-step
latency), bandwidth (bytes through the busiest port / that link's bandwidth) and the fixed
software overhead of one call. Keeping the terms apart is what lets a prediction name its
bottleneck ("inter-node bandwidth", "latency of 2(n-1) ring steps"). Workers are numbered node by
node (ranks 0..g-1 on node 0, ...), each node has one network port of the inter-node bandwidth
(all its NICs together) and each worker one intra-node port.

    ring               2(p-1) steps (2(N-1) of them between nodes); 2(p-1)/p * n through every port
    tree               pipelined double binary tree between nodes, chain within: 2((g-1) + ceil(log2 N))
                       steps; 2n through an interior port (n when p = 2)
    halving-doubling   recursive halving reduce-scatter + recursive doubling all-gather: 2 log2 p
                       steps, 2(p-1)/p * n in all; + 2 steps of n when p is not a power of two
    hierarchical       reduce-scatter within nodes, all-reduce of n/g between nodes (g streams
                       sharing the node's port), all-gather within nodes
    nvls               (NVSwitch clusters with NVLink SHARP) the switch reduces and broadcasts: about
                       n through every GPU port, 2 steps; between nodes as hierarchical, pipelined
                       with the switch's part (the slower phase sets the bandwidth)
With SHARP on the inter-node fabric (Cluster.sharp) the between-nodes phase of hierarchical and nvls
is an in-network reduction: n through each node's port, 2 steps.

The formulas and their sources (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009; Sanders,
Speck & Traeff 2009; NCCL's tuning model) are in docs/performance-model.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from dpscale.errors import ConfigError
from dpscale.lab.predict.cluster import INTER, INTRA, NVLS_EFFICIENCY, Cluster, Layout, Link, size_factor

ALGORITHMS = ("ring", "tree", "halving-doubling", "hierarchical", "nvls")
ALGORITHM_CHOICES = (*ALGORITHMS, "auto")  # auto: the fastest per message size, as NCCL's tuner picks


@dataclass(frozen=True)
class Term:
    kind: str  # "latency", "bandwidth" or "overhead"
    link: str  # INTRA, INTER, "software", or a measured transport's name
    seconds: float
    label: str  # the bottleneck in words when this term dominates


@dataclass(frozen=True)
class AllReduceCost:
    algorithm: str  # the algorithm used ("auto" resolves to one), or "measured <transport>"
    nbytes: float
    terms: tuple[Term, ...] = ()

    @property
    def seconds(self) -> float:
        return sum(t.seconds for t in self.terms)

    def dominant(self) -> Term | None:
        return max(self.terms, key=lambda t: t.seconds, default=None)


def _overhead(c: Cluster) -> Term:
    return Term("overhead", "software", c.per_message_overhead_us * 1e-6, "per-message overhead")


# NCCL's tuning model gives the tree all-reduce 0.92 of the ring's bus bandwidth (src/graph/tuning.cc)
TREE_BANDWIDTH_FACTOR = 0.92


def _bandwidth(link: Link, nbytes: float, c: Cluster, algorithm_factor: float = 1.0) -> list[Term]:
    """Bytes over a link at its nominal rate, plus what falling short of it and congestion add.

    Kept as separate terms so that the bottleneck can say which: the nominal rate, the achieved
    fraction (Link.efficiency x the algorithm's factor, when the cluster models it) or congestion.
    """
    nominal = nbytes / link.bandwidth_Bps
    efficiency = link.efficiency * algorithm_factor if c.achieved_bandwidth else 1.0
    achieved = nominal / efficiency
    return [
        Term("bandwidth", link.name, nominal, f"{link.name} bandwidth"),
        Term("bandwidth", link.name, achieved - nominal, f"{link.name} achieved-bandwidth shortfall"),
        Term("bandwidth", link.name, achieved * (link.congestion - 1), f"{link.name} congestion"),
    ]


def _latency(link: Link, steps: int, label: str) -> Term:
    return Term("latency", link.name, steps * link.latency_s, label)


def _slowest(lay: Layout, c: Cluster) -> Link:
    """The link that limits a pipelined flat algorithm: the slower one in use."""
    if lay.nodes == 1:
        return c.intra
    if lay.per_node == 1:
        return c.inter
    return min(c.intra, c.inter, key=lambda link: _rate(link, c))


def _rate(link: Link, c: Cluster) -> float:
    """Bytes/s the link moves for this job: nominal x achieved fraction / congestion."""
    return link.bandwidth_Bps * (link.efficiency if c.achieved_bandwidth else 1.0) / link.congestion


def _cost(name: str, nbytes: float, c: Cluster, terms: list[Term]) -> AllReduceCost:
    return AllReduceCost(name, nbytes, tuple(t for t in [*terms, _overhead(c)] if t.seconds > 0))


def ring(nbytes: float, lay: Layout, c: Cluster) -> AllReduceCost:
    # A chunk travels 2(p-1) hops, 2(N-1) of them between nodes: latency adds up hop by hop (as
    # NCCL's tuning model counts it) while bandwidth is set by the slowest port in the ring.
    p, inter_steps = lay.world_size, 2 * (lay.nodes - 1)
    label = "latency of 2(n-1) ring steps"
    return _cost(
        "ring",
        nbytes,
        c,
        [
            _latency(c.intra, 2 * (p - 1) - inter_steps, label),
            _latency(c.inter, inter_steps, label),
            *_bandwidth(_slowest(lay, c), 2 * (p - 1) / p * nbytes, c),
        ],
    )


def tree(nbytes: float, lay: Layout, c: Cluster) -> AllReduceCost:
    # Reduce up and broadcast down, pipelined in chunks: the depth is paid in latency twice, and
    # an interior port carries 2n (n/2 per tree up and down, interior in one tree, leaf in the other).
    g, nodes = lay.per_node, lay.nodes
    label = "latency of 2 log2(n) tree steps"
    per_port = nbytes if lay.world_size == 2 else 2 * nbytes
    return _cost(
        "tree",
        nbytes,
        c,
        [
            _latency(c.intra, 2 * (g - 1), label),
            _latency(c.inter, 2 * math.ceil(math.log2(nodes)), label),
            *_bandwidth(_slowest(lay, c), per_port, c, TREE_BANDWIDTH_FACTOR),
        ],
    )


def halving_doubling(nbytes: float, lay: Layout, c: Cluster) -> AllReduceCost:
    # Rabenseifner: round k exchanges n/2^(k+1) with the partner at distance 2^k, twice (halving,
    # then doubling). Distances grow from 1, so the large early halves stay inside a node; a round
    # that crosses nodes has all g workers of a node sending through its one port at once.
    p, g = lay.world_size, lay.per_node
    p2 = 1 << (p.bit_length() - 1)  # largest power of two <= p
    label = "latency of 2 log2(n) halving-doubling steps"
    steps = {INTRA: 0, INTER: 0}
    volume = {INTRA: 0.0, INTER: 0.0}
    for k in range(p2.bit_length() - 1):
        half = nbytes / 2 ** (k + 1)
        if lay.nodes == 1 or g % 2 ** (k + 1) == 0:
            steps[INTRA] += 2
            volume[INTRA] += 2 * half
        else:
            steps[INTER] += 2
            volume[INTER] += 2 * g * half
    terms = [
        _latency(c.intra, steps[INTRA], label),
        _latency(c.inter, steps[INTER], label),
        *_bandwidth(c.intra, volume[INTRA], c),
        *_bandwidth(c.inter, volume[INTER], c),
    ]
    if p != p2:
        # The p - p2 extra workers first hand their whole vector to a partner and get the result
        # back at the end: two more steps of n (the simple variant; Thakur et al. section 4.4).
        slow = _slowest(lay, c)
        terms += [_latency(slow, 2, label), *_bandwidth(slow, 2 * nbytes, c)]
    return _cost("halving-doubling", nbytes, c, terms)


def _between_nodes(nbytes: float, lay: Layout, c: Cluster) -> list[Term]:
    """The inter-node phase of a two-level all-reduce: a ring of the nodes' ports (each node sends
    2(N-1)/N * n, its g workers' streams together), or with SHARP one reduction in the network
    (each node sends n up and receives n down, over 2 steps)."""
    nodes = lay.nodes
    if nodes == 1:
        return []
    if c.sharp:
        return [
            _latency(c.inter, 2, "latency of the in-network (SHARP) reduction"),
            *_bandwidth(c.inter, nbytes, c),
        ]
    return [
        _latency(c.inter, 2 * (nodes - 1), "latency of 2(nodes-1) inter-node ring steps"),
        *_bandwidth(c.inter, 2 * (nodes - 1) / nodes * nbytes, c),
    ]


def hierarchical(nbytes: float, lay: Layout, c: Cluster) -> AllReduceCost:
    # dpscale's hierarchical transport and NCCL-style 2D all-reduce: the inter-node phase moves n/g
    # per worker, but the g workers of a node share its port, so the node still sends 2(N-1)/N * n.
    g = lay.per_node
    return _cost(
        "hierarchical",
        nbytes,
        c,
        [
            _latency(c.intra, 2 * (g - 1), "latency of 2(g-1) intra-node steps"),
            *_bandwidth(c.intra, 2 * (g - 1) / g * nbytes, c),
            *_between_nodes(nbytes, lay, c),
        ],
    )


def nvls(nbytes: float, lay: Layout, c: Cluster) -> AllReduceCost:
    # NVLink SHARP: each GPU writes its n bytes into the switch, which reduces them, and reads the
    # result back (multimem stores and loads): about n through every GPU port each way instead of
    # the ring's 2(g-1)/g n, at NVLS_EFFICIENCY of the line rate (cluster.py, _NVLS); 2 steps (reduce,
    # broadcast) of the link's latency, assumed. Between nodes as hierarchical (a ring of the nodes,
    # or SHARP), but pipelined with the switch's part in chunks, as NCCL's NVLS kernels run them: the
    # slower of the two phases sets the bandwidth term, and both latencies add.
    inside = _bandwidth(c.intra, nbytes, c, NVLS_EFFICIENCY / c.intra.efficiency)
    between = _between_nodes(nbytes, lay, c)
    latencies = [t for t in between if t.kind == "latency"]
    streams = [t for t in between if t.kind == "bandwidth"]
    slower = inside if sum(t.seconds for t in inside) >= sum(t.seconds for t in streams) else streams
    return _cost(
        "nvls",
        nbytes,
        c,
        [_latency(c.intra, 2, "latency of the in-switch (NVLS) reduction"), *latencies, *slower],
    )


COST_FUNCTIONS: dict[str, Callable[[float, Layout, Cluster], AllReduceCost]] = {
    "ring": ring,
    "tree": tree,
    "halving-doubling": halving_doubling,
    "hierarchical": hierarchical,
    "nvls": nvls,
}


def available(name: str, lay: Layout, c: Cluster) -> bool:
    """Whether the algorithm runs here: nvls only on a cluster whose switch reduces, >= 2 per node."""
    return name != "nvls" or (c.nvls and lay.per_node > 1)


def measured(nbytes: float, lay: Layout, c: Cluster) -> AllReduceCost:
    """The transport's own time at this world size, as `dpscale bench allreduce` measured it."""
    m = c.measured[lay.world_size]
    total_s = m.time_us(nbytes) * 1e-6
    latency_s = min(m.latency_us() * 1e-6, total_s)
    terms = (
        Term("latency", m.transport, latency_s, f"measured {m.transport} all-reduce latency"),
        Term("bandwidth", m.transport, total_s - latency_s, f"measured {m.transport} all-reduce bandwidth"),
    )
    return AllReduceCost(f"measured {m.transport}", nbytes, tuple(t for t in terms if t.seconds > 0))


def all_reduce_cost(
    nbytes: float, world_size: int, cluster: Cluster, algorithm: str = "auto"
) -> AllReduceCost:
    """The cost of summing `nbytes` over `world_size` workers of `cluster` with `algorithm`.

    A world size the cluster has measurements for uses them whatever the algorithm (the transport
    runs its own); world size 1 moves nothing and costs nothing otherwise.
    """
    if algorithm not in ALGORITHM_CHOICES:
        raise ConfigError(f"--algorithm: unknown {algorithm!r}; choose from {', '.join(ALGORITHM_CHOICES)}")
    if nbytes < 0:
        raise ConfigError(f"message size must be >= 0 bytes, got {nbytes}")
    lay = cluster.layout(world_size)
    if world_size in cluster.measured:
        return measured(nbytes, lay, cluster)
    if world_size == 1:
        return AllReduceCost("none", nbytes)
    return _by_size(_modelled(nbytes, lay, cluster, algorithm), lay, cluster)


def _by_size(cost: AllReduceCost, lay: Layout, c: Cluster) -> AllReduceCost:
    """The cost with the measured shortfall at its size (Cluster.size_factors) of the level it
    crosses: what a calibration measured beyond the fitted link, carried to this world size."""
    level = INTER if lay.nodes > 1 else INTRA
    points = c.size_factors.get(level)
    if not points:
        return cost
    factor = size_factor(points, cost.nbytes)
    if factor < 1:  # measured faster than the fitted link at this size: every term shrinks alike
        return replace(cost, terms=tuple(replace(t, seconds=t.seconds * factor) for t in cost.terms))
    extra = Term("bandwidth", level, cost.seconds * (factor - 1), f"{level} measured shortfall at this size")
    return replace(cost, terms=(*cost.terms, extra)) if extra.seconds > 0 else cost


def _modelled(nbytes: float, lay: Layout, cluster: Cluster, algorithm: str) -> AllReduceCost:
    world_size = lay.world_size
    if algorithm == "auto":
        # ties go to the first in ALGORITHMS order (ring), the simplest
        return min(
            (f(nbytes, lay, cluster) for name, f in COST_FUNCTIONS.items() if available(name, lay, cluster)),
            key=lambda cost: cost.seconds,
        )
    if not available(algorithm, lay, cluster):
        raise ConfigError(
            f"--algorithm nvls: {cluster.name} has no in-switch reduction at {world_size} workers "
            "(NVSwitch with NVLink SHARP, 2 or more per node); choose another algorithm"
        )
    return COST_FUNCTIONS[algorithm](nbytes, lay, cluster)
