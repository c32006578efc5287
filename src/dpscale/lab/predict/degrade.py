"""What degrades large data-parallel jobs beyond the alpha-beta cost: each term documented and switchable.

The link model (costs.py) prices an all-reduce on ideal links. At 128-1024 workers four more things
cost time, and a prediction that leaves them out is optimistic by 5-15 points of efficiency
(docs/performance-model.md, "Published results"):

- **Stragglers**: a synchronous step waits for its slowest worker. One worker's step compute varies
  from step to step (coefficient of variation `compute_cv`, measured by `dpscale profile` or given);
  the expected maximum of N such times is mean x (1 + cv x E[max of N standard normals]), which grows
  like sqrt(2 ln N) (Gumbel's extreme-value limit). `expected_max_normal` integrates
  E[max] = integral of x N phi(x) Phi(x)^(N-1) dx numerically (cached per N) rather than take an
  asymptotic form: sqrt(2 ln N) is 43% high at N = 8 and still 15% high at 1024, and Blom's
  Phi^-1((N - 0.375)/(N + 0.25)) 4% high at N = 2 (tests/lab/predict/test_degrade.py).
  Noise has two sources with different reach: the device itself (`compute_cv`, independent per
  worker) and what a node's workers share, its host and its path through the network (`node_cv`:
  OS daemons and interrupts, the input pipeline, the NIC; Petrini, Kerbyson & Pakin, SC 2003, and
  Hoefler, Schneider & Lumsdaine, SC 2010, show such per-node noise costing synchronizing jobs more
  the more nodes they span). The step then waits for mean x (1 + cv x E_N + node_cv x E_nodes): a
  job inside one node pays only the device's share. (The sum of the two expected maxima bounds the
  expected maximum of the sum from above; at these cvs the difference is a fraction of a point.)
- **Achieved bandwidth**: collectives reach a fraction of the link's nominal rate (protocol headers,
  the reduction kernel, chunking). Each link carries its `efficiency` (presets: from published
  nccl-tests results, cluster.py); NCCL's own tuning model further multiplies the tree's bandwidth by
  0.92 (src/graph/tuning.cc), applied in costs.py. The message-size dependence is the latency term's.
- **Congestion**: the inter-node fabric loses bandwidth as more nodes share it: an uplink
  `oversubscription` ratio once a job spans more than `nodes_per_switch` nodes, and flow collisions in
  ECMP-routed fabrics (Al-Fares et al., SIGCOMM 2008; Hedera, NSDI 2010), modelled as
  `congestion_per_doubling` of bandwidth lost per doubling of the nodes (fitted, not from a source).
- **Overlap interference**: backward runs slower while a reduction runs beside it (memory bandwidth,
  SMs or cores taken by the collective): backward is stretched by `interference` x the communication
  it hides.
- **Input pipeline**: a node's host decodes and augments the samples all of its workers consume
  (JPEG decode for images: NVIDIA's ResNet-50 examples run it on the host's CPUs, 8-16 loader
  workers per GPU). With prefetching the pipeline runs beside the step, so the step takes
  max(step, workers on the node x per-worker batch / the node's input rate): a job whose demand
  stays below the rate loses nothing, one above it waits for data. The rate (`input_samples_per_s`,
  samples/s per node) is an input: `--input-samples-per-s`, measured on the node in question (the
  data loader's rate with nothing else running); no preset carries one, since no source at hand
  publishes a host's decode rate (docs/performance-model.md, "Published results").

The model (model.py) applies them; each has a switch here and a `--no-...` flag on the CLI, so a term's
share of the step is the difference with and without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist

from dpscale.errors import ConfigError

STRAGGLERS = "stragglers (waiting for the slowest worker)"
INTERFERENCE = "overlap interference (backward slowed by the reductions)"
INPUT_PIPELINE = "input pipeline (the host cannot feed the node's workers)"
# Gaussian quantile of the p99 tail: p99 = mean + 2.326 sigma, for --compute-tail
_P99_Z = NormalDist().inv_cdf(0.99)


@lru_cache(maxsize=256)
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normal variables] (0 for n = 1), by the midpoint rule on
    [-10, 10] in steps of 0.002: exact to 1e-6 for any n up to millions."""
    if n < 1:
        raise ConfigError(f"world size must be >= 1, got {n}")
    if n == 1:
        return 0.0
    nd, h = NormalDist(), 0.002
    total = 0.0
    for k in range(10_000):
        x = -10 + h * (k + 0.5)
        total += x * nd.pdf(x) * nd.cdf(x) ** (n - 1)
    return n * total * h


def cv_from_tail(p99_over_median: float) -> float:
    """The coefficient of variation of a Gaussian step time whose p99 is `p99_over_median` x its median."""
    if not p99_over_median >= 1:
        raise ConfigError(f"--compute-tail: p99 / median must be >= 1, got {p99_over_median}")
    return (p99_over_median - 1) / _P99_Z


@dataclass(frozen=True, kw_only=True)
class ScaleTerms:
    """The at-scale terms of a prediction; every one can be switched off to see its share."""

    stragglers: bool = True  # --no-stragglers
    # --compute-cv / --compute-tail: std / mean of one worker's step compute; None: the profile's
    # measurement, or 0 where it has none
    compute_cv: float | None = None
    # --node-cv: std / mean of the delay a node's host and network path add to all of its workers'
    # steps; None: the cluster's (GPU presets: fitted, cluster.py), 0 for a job on one node anyway
    node_cv: float | None = None
    achieved_bandwidth: bool = True  # --no-achieved-bandwidth: links at their nominal rate
    congestion: bool = True  # --no-congestion: no oversubscription, no flow collisions
    oversubscription: float = 1.0  # --oversubscription: fabric uplink ratio (2 = 2:1), beyond one switch
    # --nodes-per-switch: nodes below one leaf switch, non-blocking among themselves; None: the
    # oversubscription applies to every job of more than one node
    nodes_per_switch: int | None = None
    congestion_per_doubling: float | None = None  # --congestion-per-doubling; None: the cluster's
    overlap_interference: bool = True  # --no-interference
    interference: float | None = None  # --interference: backward slowdown per hidden ms; None: cluster's
    input_pipeline: bool = True  # --no-input-pipeline: the host feeds any demand
    # --input-samples-per-s: samples/s a node's host input pipeline delivers to all its workers
    # together; None: the cluster's, unlimited where it has none
    input_samples_per_s: float | None = None

    def __post_init__(self) -> None:
        if self.compute_cv is not None and not 0 <= self.compute_cv < 1:
            raise ConfigError(f"--compute-cv: must be in [0, 1), got {self.compute_cv}")
        if self.node_cv is not None and not 0 <= self.node_cv < 1:
            raise ConfigError(f"--node-cv: must be in [0, 1), got {self.node_cv}")
        if not self.oversubscription >= 1:
            raise ConfigError(
                f"--oversubscription: must be >= 1 (1 = non-blocking), got {self.oversubscription}"
            )
        if self.nodes_per_switch is not None and self.nodes_per_switch < 1:
            raise ConfigError(f"--nodes-per-switch: must be >= 1, got {self.nodes_per_switch}")
        if self.congestion_per_doubling is not None and not 0 <= self.congestion_per_doubling < 1:
            raise ConfigError(
                f"--congestion-per-doubling: must be in [0, 1), got {self.congestion_per_doubling}"
            )
        if self.interference is not None and not 0 <= self.interference <= 1:
            raise ConfigError(f"--interference: must be in [0, 1], got {self.interference}")
        if self.input_samples_per_s is not None and not self.input_samples_per_s > 0:
            raise ConfigError(
                f"--input-samples-per-s: must be > 0 (samples/s per node; omit it for no limit), "
                f"got {self.input_samples_per_s}"
            )

    def straggler_factor(self, cv: float, world_size: int, nodes: int = 1, node_cv: float = 0.0) -> float:
        """Slowest-of-N compute over one worker's mean compute: each worker's own noise (cv) and each
        node's shared noise (node_cv, over the nodes)."""
        if not self.stragglers:
            return 1.0
        return 1.0 + cv * expected_max_normal(world_size) + node_cv * expected_max_normal(nodes)

    def congestion_factor(self, nodes: int, per_doubling: float) -> float:
        """How much slower the inter-node fabric moves bytes for a job on `nodes` nodes (>= 1)."""
        if not self.congestion or nodes <= 1:
            return 1.0
        factor = 1.0
        if self.nodes_per_switch is None or nodes > self.nodes_per_switch:
            factor = self.oversubscription
        # a fraction `per_doubling` of the bandwidth is lost per doubling of the nodes
        return factor / (1.0 - per_doubling) ** math.log2(nodes)

    def input_ms(self, workers_on_node: int, per_worker_batch: int, rate: float | None) -> float:
        """How long the node's host pipeline takes to prepare one step's samples for its workers
        (0: no limit, or the term switched off)."""
        if not self.input_pipeline or rate is None:
            return 0.0
        return 1e3 * workers_on_node * per_worker_batch / rate
