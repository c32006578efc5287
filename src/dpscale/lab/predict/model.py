"""The prediction per world size: step time, throughput, efficiency and the bottleneck in words.

For N workers, from a one-worker profile and a cluster:

    compute_ms  = (forward + backward + engine overhead + optimizer) x contention x stragglers(N)
                  + interference x the communication backward hides
                  (+ loading the batch in the worker's own loop, with --data-workers 0)
    comm_ms     = sum over buckets of [all_reduce_cost(bucket bytes / compression, N) x level + call overhead]
                  (on a CPU cluster with a measured compression cost, the casts to fp16 and back
                  lengthen backward: compression_cost.py)
                  (links at their achieved rate, the inter-node one slowed by congestion at N nodes)
    exposed     = what the bucket timeline (timeline.py) leaves after the end of backward
    step_ms     = max(compute_ms + exposed, the node's host input pipeline's time for its workers' samples)
    samples/s   = N x per-worker batch / step
    efficiency  = samples/s / (N x one-worker samples/s with no communication and no contention)

`contention` is how much slower one worker computes when others share its node (memory bandwidth,
cores, caches): --contention, else the profile's measurement for that many workers on a node
(`dpscale profile --co-located K`; not a CPU profile's on a GPU cluster), else 1. The engine
overhead is the profile's measured cost of the engine at one worker (copying gradients into
buckets), spent during backward.

With a sync calibration (sync.py, `dpscale profile --co-located N`) for `sync_transport` at N, what
a synchronized step costs beyond free-running compute and the tight loop (waiting for the slowest
peer, waking the transport's threads, slower compute after the wait) is added per call, and the
cluster's all-reduce times are scaled to the calibration's own tight-loop level for the same buckets
(the bench gives the shape over sizes; the level drifts with the load of a shared machine). The
engine overhead then loses the one-worker gloo calls it was measured with. Without a calibration,
neither applies.

The at-scale terms (stragglers, achieved bandwidth, congestion, overlap interference, input pipeline)
are degrade.py's;
each can be switched off in `PredictConfig.terms`. `Prediction.losses_ms` says what each costs the
step beyond ideal compute (the exposed communication split over its terms in proportion), and the
bottleneck is the largest of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace

from dpscale.engine.factory import DPSCALE_ON_SHM, PROFILE_ENGINES
from dpscale.errors import ConfigError
from dpscale.lab.predict.cluster import Cluster
from dpscale.lab.predict.compression_cost import CompressionCost
from dpscale.lab.predict.costs import ALGORITHM_CHOICES, AllReduceCost, Term, all_reduce_cost
from dpscale.lab.predict.degrade import INPUT_PIPELINE, INTERFERENCE, STRAGGLERS, ScaleTerms
from dpscale.lab.predict.error_band import error_band
from dpscale.lab.predict.profile import MB, ModelProfile
from dpscale.lab.predict.sync import SyncCost
from dpscale.lab.predict.timeline import BucketSpan, ReadyBucket, simulate

ENGINE_CHOICES = (*PROFILE_ENGINES, "none")
# Exposed communication below this share of the step is noise next to compute.
COMPUTE_BOUND_SHARE = 0.05
# what one prediction handles within a second (docs/performance-model.md): its work grows with
# buckets x world sizes, and straggler terms with the world size
MAX_BUCKET_PREDICTIONS = 6000  # buckets x world sizes: ~0.5 s measured at load 5 on 2 cores
MAX_WORLD_SIZES = 64
MAX_WORLD_SIZE = 1 << 20
IN_STEP_LABEL = "in-step call overhead (waiting for peers, thread wake-ups)"
CASTS_LABEL = "fp16 casts on the CPU (compression)"
ENGINE_PROFILE_TRANSPORT = "gloo"  # profiling.py times the engines on a one-worker gloo group
SHM_TRANSPORTS = ("shm",)  # all in shared memory (hierarchical also calls gloo between hosts)
JSON_KEYS = (
    "world_size",
    "nodes",
    "step_ms",
    "compute_ms",
    "comm_ms",
    "exposed_comm_ms",
    "samples_per_s",
    "efficiency",
    "efficiency_low",
    "efficiency_high",
    "bottleneck",
)
# derived from efficiency (error_band.py), not stored: a report re-reads the others
BAND_KEYS = ("efficiency_low", "efficiency_high")


@dataclass(frozen=True, kw_only=True)
class PredictConfig:
    world_sizes: list[int]  # --world-sizes (or --nodes): each fills nodes of the cluster's workers/node
    per_worker_batch: int | None = None  # --per-worker-batch: None = the profile's; else compute scaled
    bucket_mb: float = 25.0  # --bucket-mb: bucket cap in MiB (the first bucket is first_bucket_mb)
    # None: bucket_mb, the layout the engine (and torch 2.13's DDP) builds for an explicit cap, as
    # dpscale train, the benches and the profile give it (engine/registry.wrap); 1.0 models a
    # script that leaves DDP's cap at its default (a small first bucket, so communication starts early)
    first_bucket_mb: float | None = None
    overlap: bool = True  # --no-overlap: every reduction waits for the end of backward
    compression: float = 1.0  # --compression: bytes on the wire = gradient bytes / compression
    # with compression > 1 on a CPU cluster: what casting to fp16 and back costs a worker on this
    # host (compression_cost.measure); None: nothing beyond the halved transfer
    compression_cost: CompressionCost | None = None
    algorithm: str = "auto"  # --algorithm: one of ALGORITHM_CHOICES
    engine: str = "dpscale"  # --engine: whose measured one-worker overhead to add; "none" adds none
    # --contention: compute time multiplier when a node holds > 1 worker; None: the profile's
    # measured factor for that many workers per node, or 1 where it has none
    contention: float | None = None
    # --transport (with --calibrate): whose in-step sync terms from the profile apply; None: none
    sync_transport: str | None = None
    # --data-workers: loader processes per worker, as `dpscale train --data-workers`: with the
    # profile's input rate, 0 loads in each worker's own loop (before every step) and K > 0 in K
    # processes each, ahead of the step; None: no input term from the profile
    data_workers: int | None = None
    # stragglers, bandwidth, congestion, interference, input pipeline
    terms: ScaleTerms = field(default_factory=ScaleTerms)

    def first_bucket(self) -> float:
        """The first bucket's cap in MiB (resolved at use, so replace(bucket_mb=...) follows)."""
        return self.bucket_mb if self.first_bucket_mb is None else self.first_bucket_mb

    def __post_init__(self) -> None:
        if not self.world_sizes or any(n < 1 for n in self.world_sizes):
            raise ConfigError(f"--world-sizes: give world sizes >= 1, got {self.world_sizes}")
        if len(self.world_sizes) > MAX_WORLD_SIZES or max(self.world_sizes) > MAX_WORLD_SIZE:
            raise ConfigError(
                f"--world-sizes: at most {MAX_WORLD_SIZES} world sizes of at most {MAX_WORLD_SIZE:,} "
                f"workers each (one prediction stays within a second); got {len(self.world_sizes)}, "
                f"up to {max(self.world_sizes):,}"
            )
        if self.per_worker_batch is not None and self.per_worker_batch < 1:
            raise ConfigError(f"--per-worker-batch: must be >= 1, got {self.per_worker_batch}")
        if not self.bucket_mb > 0 or not self.first_bucket() > 0:
            raise ConfigError(f"--bucket-mb: must be > 0, got {self.bucket_mb}")
        if not self.compression >= 1:
            raise ConfigError(f"--compression: must be >= 1 (2 for fp16 gradients), got {self.compression}")
        if self.algorithm not in ALGORITHM_CHOICES:
            raise ConfigError(
                f"--algorithm: unknown {self.algorithm!r}; choose from {', '.join(ALGORITHM_CHOICES)}"
            )
        if self.engine not in ENGINE_CHOICES:
            raise ConfigError(f"--engine: unknown {self.engine!r}; choose from {', '.join(ENGINE_CHOICES)}")
        if self.data_workers is not None and self.data_workers < 0:
            raise ConfigError(
                f"--data-workers: must be >= 0 (0: in each worker's loop), got {self.data_workers}"
            )
        if self.contention is not None and not self.contention > 0:
            raise ConfigError(f"--contention: must be > 0 (1 = none), got {self.contention}")


@dataclass(frozen=True)
class Prediction:
    world_size: int
    nodes: int
    step_ms: float
    compute_ms: float
    comm_ms: float  # all reductions, hidden or not
    exposed_comm_ms: float
    samples_per_s: float
    efficiency: float
    bottleneck: str
    algorithms: str  # the algorithm(s) the buckets used, e.g. "ring" or "tree, ring"
    terms_ms: dict[str, float] = field(default_factory=dict)  # comm time by term label, all buckets
    # what each term adds to the step beyond ideal compute (exposed comm split by term, stragglers, ...)
    losses_ms: dict[str, float] = field(default_factory=dict)
    spans: tuple[BucketSpan, ...] = ()

    @property
    def efficiency_low(self) -> float:
        """The low end of the band the method's held-out error gives this efficiency (error_band.py)."""
        return error_band().around(self.efficiency, self.world_size)[0]

    @property
    def efficiency_high(self) -> float:
        return error_band().around(self.efficiency, self.world_size)[1]

    def to_dict(self) -> dict:
        """The documented JSON object (JSON_KEYS)."""
        return {k: getattr(self, k) for k in JSON_KEYS}

    def to_full_dict(self) -> dict:
        return asdict(self)


def _losses(exposed_ms: float, terms_ms: dict[str, float], extra: dict[str, float]) -> dict[str, float]:
    """What each term adds to the step: the exposed communication shared out in proportion to the
    terms' communication time, plus the compute-side terms (stragglers, interference)."""
    comm = sum(terms_ms.values())
    out = {k: exposed_ms * v / comm for k, v in terms_ms.items()} if comm > 0 and exposed_ms > 0 else {}
    out.update({k: v for k, v in extra.items() if v > 0})
    return out


def _bottleneck(world_size: int, step_ms: float, losses_ms: dict[str, float]) -> str:
    if world_size == 1:
        # one worker waits for no peer; only its host's input pipeline can hold it back
        waiting = losses_ms.get(INPUT_PIPELINE, 0.0) > COMPUTE_BOUND_SHARE * step_ms
        return INPUT_PIPELINE if waiting else "compute"
    if sum(losses_ms.values()) <= COMPUTE_BOUND_SHARE * step_ms:
        return "compute"
    return max(losses_ms, key=losses_ms.__getitem__)


def _casts_ms(prof: ModelProfile, cluster: Cluster, config: PredictConfig, n: int) -> float:
    """What compressing costs one worker's step on a CPU cluster at `n` workers (GPUs cast at
    memory speed: nothing)."""
    cost = config.compression_cost
    if cost is None or config.compression <= 1 or cluster.gpu:
        return 0.0
    return cost.extra_ms(prof.param_bytes, n)


def _level(sync: SyncCost, cluster: Cluster, config: PredictConfig) -> float:
    """The calibration's tight-loop time over the cluster's for the same buckets: the cluster (the
    all-reduce bench) gives how the time grows with size, the sync calibration its level then."""
    n = sync.world_size
    model_ms = sum(all_reduce_cost(b, n, cluster, config.algorithm).seconds * 1e3 for b in sync.bucket_bytes)
    return sync.tight_comm_ms / model_ms if model_ms > 0 and sync.tight_comm_ms > 0 else 1.0


def _ready(buckets: list[ReadyBucket], prof: ModelProfile, backward_ms: float) -> list[ReadyBucket]:
    """The profile's bucket ready times stretched to a backward of `backward_ms`."""
    stretch = backward_ms / prof.backward_ms if prof.backward_ms > 0 else 1.0
    return [ReadyBucket(b.index, b.nbytes, min(b.ready_ms * stretch, backward_ms)) for b in buckets]


def _input(
    prof: ModelProfile, cluster: Cluster, config: PredictConfig
) -> tuple[float, Callable[[int], float | None]]:
    """(ms each worker spends loading its batch in its own loop, the node's input rate for k workers
    on it or None): --input-samples-per-s or the cluster's rate; else, with --data-workers, the
    profile's one-process rate (0: loaded in the loop; K: K loader processes per worker, assumed to
    have cores of their own)."""
    terms = config.terms
    given = terms.input_samples_per_s or cluster.input_samples_per_s
    one = prof.input_samples_per_s
    if given is not None or not terms.input_pipeline or config.data_workers is None:
        return 0.0, lambda k: given
    if not one:
        raise ConfigError(
            "--data-workers: the profile has no measured input rate (explicit numbers, or measured "
            "before it was recorded); measure one with `dpscale profile`, or give --input-samples-per-s"
        )
    if config.data_workers == 0:
        return 1e3 * prof.per_worker_batch / one, lambda k: None
    return 0.0, lambda k: one * config.data_workers * k


def _engine_overhead(prof: ModelProfile, config: PredictConfig) -> tuple[float, str]:
    """The engine's measured one-worker overhead, and the transport it was measured on."""
    overhead_ms = prof.engine_overhead_ms.get(config.engine, 0.0)
    profiled_on = ENGINE_PROFILE_TRANSPORT
    if config.engine == "dpscale" and config.sync_transport in SHM_TRANSPORTS:
        if DPSCALE_ON_SHM in prof.engine_overhead_ms:  # measured without gloo's hand-offs
            overhead_ms, profiled_on = prof.engine_overhead_ms[DPSCALE_ON_SHM], "shm"
    return overhead_ms, profiled_on


def _variation(
    prof: ModelProfile, cluster: Cluster, config: PredictConfig
) -> tuple[float, float, float, float]:
    """The step-to-step variation, a node's shared noise, interference and congestion per doubling:
    each given, else measured in the profile, else the cluster's."""
    terms = config.terms
    # the step-to-step variation: given, else the profile's measurement, else the cluster's devices'
    cv = terms.compute_cv
    cv = (prof.compute_cv if prof.compute_cv is not None else cluster.compute_cv) if cv is None else cv
    # the noise a node's host and network path add (shared by its workers): given, else the cluster's
    node_cv = cluster.node_cv if terms.node_cv is None else terms.node_cv
    # interference: given, else the profile's measurement (--co-located), else the cluster's devices'
    interference = terms.interference
    if interference is None:
        interference = prof.interference if prof.interference is not None else cluster.interference
    if not terms.overlap_interference or not config.overlap:
        interference = 0.0
    per_doubling = terms.congestion_per_doubling
    per_doubling = cluster.congestion_per_doubling if per_doubling is None else per_doubling
    return cv, node_cv, interference, per_doubling


def check_bounds(profile: ModelProfile, config: PredictConfig, *, batches: int = 1) -> None:
    """ConfigError when the model's gradients make more buckets than a prediction handles within a
    second (each world size times each bucket); say so before laying them out (--params 1e300
    made the layout loop until memory ran out)."""
    if not profile.param_bytes >= 1:
        raise ConfigError(f"--params: the model has {profile.param_bytes} bytes of gradients; give >= 1")
    cap = config.bucket_mb * MB
    sizes = len(config.world_sizes) * batches  # goodput predicts each per-worker batch
    buckets = profile.param_bytes / cap
    if buckets * sizes > MAX_BUCKET_PREDICTIONS:
        most = MAX_BUCKET_PREDICTIONS // sizes
        raise ConfigError(
            f"--params: {profile.param_bytes:.3g} bytes of gradients make {buckets:.3g} buckets of "
            f"--bucket-mb {config.bucket_mb:g}; {sizes} prediction(s) (world sizes x batches) handle at most "
            f"{most} (one call within a second): give --bucket-mb "
            f"{math.ceil(profile.param_bytes / max(1, most) / MB)} or more, or fewer --world-sizes"
        )


def predict(
    profile: ModelProfile,
    cluster: Cluster,
    config: PredictConfig,
    *,
    contention_by_world_size: Mapping[int, float] | None = None,
) -> list[Prediction]:
    """One prediction per world size of `config`, in its order.

    `contention_by_world_size` (e.g. measured: the local engine's step at N over its step at 1)
    replaces `config.contention` for the world sizes it names.

    A profile that records each rank's work per optimizer step at each world size (`dpscale
    scale`'s) is predicted at that work for each N, unless --per-worker-batch sets one; efficiency
    then compares with one worker doing the N=1 work.
    """
    check_bounds(profile, config)
    if profile.per_worker_batch_by_world_size and config.per_worker_batch is None:
        return _predict_by_work(profile, cluster, config, contention_by_world_size)
    prof = profile.at_batch(config.per_worker_batch or profile.per_worker_batch)
    batch = prof.per_worker_batch
    overhead_ms, profiled_on = _engine_overhead(prof, config)
    terms = config.terms
    loading_ms, input_rate = _input(prof, cluster, config)
    # one worker, nothing to communicate, no contention (but fed by one host like any other)
    baseline_ms = max(prof.compute_ms + overhead_ms + loading_ms, terms.input_ms(1, batch, input_rate(1)))
    buckets = prof.buckets(config.bucket_mb, config.first_bucket())
    out = []
    cv, node_cv, interference, per_doubling = _variation(prof, cluster, config)
    # CPU workers on one host share its cores and memory; a node's GPUs each compute on their own,
    # so a CPU profile's contention says nothing about them (--contention still applies)
    measured_contention = {} if prof.device == "cpu" and cluster.gpu else prof.contention
    for n in config.world_sizes:
        lay = cluster.layout(n)
        at_n = replace(
            cluster,
            inter=replace(cluster.inter, congestion=terms.congestion_factor(lay.nodes, per_doubling)),
            achieved_bandwidth=cluster.achieved_bandwidth and terms.achieved_bandwidth,
        )
        factor = 1.0
        if lay.per_node > 1:
            factor = config.contention or measured_contention.get(lay.per_node, 1.0)
        if contention_by_world_size and n in contention_by_world_size:
            factor = contention_by_world_size[n]
        engine_ms, call_s, level = overhead_ms, 0.0, 1.0
        sync = prof.sync_cost(config.sync_transport, n) if config.sync_transport else None
        if sync is not None:
            call_s = sync.call_overhead_ms / 1e3
            level = _level(sync, at_n, config)
            one = prof.sync_cost(profiled_on, 1)
            if one is not None:
                # the engine overhead was measured with one worker on gloo (or shm), so it holds
                # that transport's one-worker calls: swap those for this transport's at this size
                engine_ms = max(0.0, overhead_ms - one.step_comm_ms)
        # the step waits for the slowest of n workers: every phase of it is that much longer
        slowest = terms.straggler_factor(cv, n, lay.nodes, node_cv)
        casts_ms = _casts_ms(prof, cluster, config, n) * factor  # compute on the worker's cores
        backward_ms = (prof.backward_ms + engine_ms) * factor * slowest + casts_ms
        costs: list[AllReduceCost] = []

        def reduce_ms(nbytes: int, n=n, at_n=at_n, costs=costs, call_s=call_s, level=level) -> float:
            cost = all_reduce_cost(nbytes / config.compression, n, at_n, config.algorithm)
            if level != 1.0:
                cost = replace(cost, terms=tuple(replace(t, seconds=t.seconds * level) for t in cost.terms))
            if call_s > 0:
                extra = Term("overhead", "software", call_s, IN_STEP_LABEL)
                cost = replace(cost, terms=(*cost.terms, extra))
            costs.append(cost)
            return cost.seconds * 1e3

        timeline = simulate(
            _ready(buckets, prof, backward_ms), backward_ms, reduce_ms, overlap=config.overlap
        )
        interfered_ms = 0.0
        if interference > 0 and timeline.hidden_comm_ms > 0:
            # backward runs slower while reductions run beside it; once more with the longer backward
            interfered_ms = interference * timeline.hidden_comm_ms
            backward_ms += interfered_ms
            costs.clear()
            timeline = simulate(_ready(buckets, prof, backward_ms), backward_ms, reduce_ms, overlap=True)
        compute_ms = (prof.forward_ms + prof.optimizer_ms) * factor * slowest + backward_ms + loading_ms
        step_ms = compute_ms + timeline.exposed_comm_ms
        # the host prepares the next step's samples while this one runs (prefetching): the step
        # waits only for what the pipeline cannot deliver in its time
        input_wait_ms = max(0.0, terms.input_ms(lay.per_node, batch, input_rate(lay.per_node)) - step_ms)
        step_ms += input_wait_ms
        terms_ms: dict[str, float] = {}
        for cost in costs:
            for t in cost.terms:
                terms_ms[t.label] = terms_ms.get(t.label, 0.0) + t.seconds * 1e3
        straggler_ms = (
            (prof.forward_ms + prof.optimizer_ms + prof.backward_ms + engine_ms) * factor * (slowest - 1)
        )
        losses = _losses(
            timeline.exposed_comm_ms,
            terms_ms,
            {
                STRAGGLERS: straggler_ms,
                INTERFERENCE: interfered_ms,
                INPUT_PIPELINE: input_wait_ms,
                CASTS_LABEL: casts_ms,
            },
        )
        out.append(
            Prediction(
                world_size=n,
                nodes=lay.nodes,
                step_ms=step_ms,
                compute_ms=compute_ms,
                comm_ms=timeline.comm_ms,
                exposed_comm_ms=timeline.exposed_comm_ms,
                samples_per_s=n * batch / (step_ms / 1e3),
                efficiency=baseline_ms / step_ms,
                bottleneck=_bottleneck(n, step_ms, losses),
                algorithms=", ".join(dict.fromkeys(c.algorithm for c in costs)) or "-",
                terms_ms=terms_ms,
                losses_ms=losses,
                spans=timeline.spans,
            )
        )
    return out


def _predict_by_work(
    profile: ModelProfile,
    cluster: Cluster,
    config: PredictConfig,
    contention_by_world_size: Mapping[int, float] | None,
) -> list[Prediction]:
    plain = replace(profile, per_worker_batch_by_world_size={})
    at_one = replace(config, world_sizes=[1], per_worker_batch=profile.work_at(1))
    one_worker = predict(plain, cluster, at_one)[0].samples_per_s
    out = []
    for n in config.world_sizes:
        at_n = replace(config, world_sizes=[n], per_worker_batch=profile.work_at(n))
        (p,) = predict(plain, cluster, at_n, contention_by_world_size=contention_by_world_size)
        out.append(replace(p, efficiency=p.samples_per_s / (n * one_worker)))
    return out
