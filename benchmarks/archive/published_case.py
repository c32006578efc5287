"""One published data-parallel result as the model sees it (`PublishedCase`), and its prediction.

A case carries what its source states (model, GPUs, per-GPU batch, interconnect, the efficiency and
how the source computed it) and, where the source does not give an input the model needs, an
assumption that says so in `notes`. Efficiency is put the way the source puts it: throughput at N
over (N / baseline) x throughput at the source's baseline (one GPU or one server), i.e. with the
per-GPU batch fixed, step time at the baseline / step time at N (`reproduce`). The cases themselves
are in published_cases.py, the fit and the held-out study in published.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dpscale.lab.predict.cluster import Cluster, preset_cluster
from dpscale.lab.predict.degrade import ScaleTerms
from dpscale.lab.predict.model import PredictConfig, predict
from dpscale.lab.predict.profile import ModelProfile, ParamTiming, explicit

TARGET_POINTS = 3.0  # the target: within 3 points of every published efficiency
WORST_POINTS = 5.0  # and never more than 5


@dataclass(frozen=True, kw_only=True)
class FitParams:
    eth_efficiency: float = 1.0  # achieved / nominal on Ethernet (TCP or RoCE) links
    compute_cv: float = 0.0  # std / mean of a GPU's step compute
    node_cv: float = 0.0  # std / mean of the delay a node's host and network add to its GPUs' steps
    interference: float = 0.0  # backward slowdown per ms of hidden communication
    congestion_per_doubling: float = 0.0  # inter-node bandwidth lost per doubling of the nodes
    # samples/s one host CPU core prepares (decode, augment) for the input pipeline; None: unlimited
    input_per_core: float | None = None


@dataclass(frozen=True, kw_only=True)
class PublishedCase:
    name: str
    family: str  # cases of one source and system; the split holds out the largest GPU count of each
    source: str  # citation of the published figure
    model: str
    params: float
    bytes_per_param: float  # of the gradients on the wire (2: fp16 all-reduce)
    per_gpu_batch: int
    single_gpu_step_ms: float  # one GPU's step at per_gpu_batch, no communication
    step_source: str  # where the single-GPU speed comes from
    backward_fraction: float
    interconnect: str  # in words, as the source describes it
    intra: str  # link presets (cluster.py), "Kx" for K in parallel
    inter: str
    workers_per_node: int
    algorithm: str
    bucket_mb: float
    overlap: bool  # reductions overlap backward (False: all-reduce after backward, e.g. after accumulation)
    baseline_gpus: int  # the source's efficiency is relative to this many GPUs
    gpus: int
    published_efficiency: float
    how: str  # how the source computed the efficiency
    notes: str = ""
    layers: tuple[tuple[float, float], ...] = ()  # (parameters, share of backward compute), input to output
    # gradient accumulation: micro-batches per all-reduce at the baseline and at `gpus` (only for
    # cases that reduce after backward: k micro-batches and one reduction are then one step of k
    # times the compute and the batch)
    accumulation: tuple[int, int] = (1, 1)
    # CPU cores of one node's host, from the system's datasheet, where the source decodes its input
    # on them (the input-pipeline term: the node's rate = cores x FitParams.input_per_core)
    host_cores: int | None = None

    def __post_init__(self) -> None:
        if self.accumulation != (1, 1) and self.overlap:
            raise ValueError(
                f"{self.name}: accumulation is modelled only for cases that reduce after backward"
            )

    def profile(self) -> ModelProfile:
        prof = explicit(
            params=round(self.params),
            bytes_per_param=self.bytes_per_param,
            step_compute_ms=self.single_gpu_step_ms,
            backward_fraction=self.backward_fraction,
            per_worker_batch=self.per_gpu_batch,
            model=self.model,
        )
        if not self.layers:
            return prof
        # backward runs from the output layer to the input: a layer's gradients are ready once the
        # backward compute of every layer after it (and its own) is done
        timings, done = [], 0.0
        for k, (count, share) in reversed(list(enumerate(self.layers))):
            done += share * prof.backward_ms
            nbytes = round(count * self.bytes_per_param)
            timings.append(ParamTiming(f"layer{k}", round(count), nbytes, min(done, prof.backward_ms)))
        params = tuple(reversed(timings))
        return replace(prof, params=params, param_bytes=sum(p.nbytes for p in params))

    @property
    def on_ethernet(self) -> bool:
        """Its inter-node link is Ethernet (TCP or RoCE), whose achieved fraction is fitted."""
        return "eth" in self.inter or "roce" in self.inter

    def cluster(self, fit: FitParams) -> Cluster:
        c = preset_cluster(f"{self.intra}+{self.inter}")
        inter = c.inter
        if self.on_ethernet:
            inter = replace(inter, efficiency=fit.eth_efficiency)
        rate = None
        if self.host_cores is not None and fit.input_per_core is not None:
            rate = self.host_cores * fit.input_per_core
        return replace(
            c,
            workers_per_node=self.workers_per_node,
            input_samples_per_s=rate,
            inter=inter,
            interference=fit.interference,
            congestion_per_doubling=fit.congestion_per_doubling,
            name=self.interconnect,
        )


@dataclass(frozen=True)
class Reproduction:
    case: PublishedCase
    predicted: float  # efficiency relative to the baseline, every term on
    bottleneck: str  # at `gpus`
    exposed_comm_ms: float
    comm_ms: float
    held_out: bool

    @property
    def error_points(self) -> float:
        return 100 * (self.predicted - self.case.published_efficiency)


def predict_at(case: PublishedCase, fit: FitParams, terms: ScaleTerms, gpus: int, steps: int):
    """One prediction at `gpus`, `steps` micro-batches per all-reduce folded into one step."""
    if steps != 1:
        case = replace(
            case, single_gpu_step_ms=case.single_gpu_step_ms * steps, per_gpu_batch=case.per_gpu_batch * steps
        )
    config = PredictConfig(
        world_sizes=[gpus],
        algorithm=case.algorithm,
        bucket_mb=case.bucket_mb,
        # the published runs' frameworks bucket their own way; the fit and the held-out figures
        # were made with a small (1 MiB) first bucket, as torch DDP's default cap builds
        first_bucket_mb=1.0,
        overlap=case.overlap,
        engine="none",
        terms=terms,
    )
    (prediction,) = predict(case.profile(), case.cluster(fit), config)
    return prediction


def reproduce(
    case: PublishedCase, fit: FitParams, *, terms: ScaleTerms | None = None, held_out: bool = False
) -> Reproduction:
    terms = terms or ScaleTerms()
    terms = replace(
        terms,
        compute_cv=fit.compute_cv if terms.compute_cv is None else terms.compute_cv,
        node_cv=fit.node_cv if terms.node_cv is None else terms.node_cv,
    )
    base_steps, steps = case.accumulation
    base = predict_at(case, fit, terms, case.baseline_gpus, base_steps)
    at_n = predict_at(case, fit, terms, case.gpus, steps)
    # per sample: a step of k micro-batches carries k times the samples
    eff = (base.step_ms / base_steps) / (at_n.step_ms / steps)
    return Reproduction(case, eff, at_n.bottleneck, at_n.exposed_comm_ms, at_n.comm_ms, held_out)


def with_accumulation(case: PublishedCase, fit: FitParams, base_steps: int, steps: int) -> float:
    """The efficiency `case` would have if its baseline ran `base_steps` micro-batches per all-reduce
    and its N GPUs `steps` (gradient accumulation)."""
    return reproduce(replace(case, accumulation=(base_steps, steps)), fit).predicted
