"""The model against an emulated multi-host cluster (emulate.py): all-reduce times and a training step.

The cluster is described to the model with the figures the emulation enforces: the tbf rate
between hosts. Compute is not taken on trust, as in validate.py: the training step's compute is the
profile scaled to the emulation's own bare-model step (every worker computing at once, the slowest
rank's, timed in the same run step by step beside the training steps), so what is checked is
communication and overlap. With `link_from_run` the link's rate is also taken from the same run (the
measured all-reduce of the largest size over the modelled one): every level then comes from the run
being checked, and what remains is how the model composes a step from them (buckets, overlap, engine
overhead), which the host's load does not move. Target: within 20%.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dpscale.lab.predict.cluster import INTER, Cluster, Link, preset_cluster
from dpscale.lab.predict.costs import all_reduce_cost
from dpscale.lab.predict.degrade import ScaleTerms
from dpscale.lab.predict.model import PredictConfig, predict
from dpscale.lab.predict.profile import ModelProfile
from predict_lab.emulate import EmulationResult

EMULATION_TARGET = 0.20


@dataclass(frozen=True)
class EmulationRow:
    what: str
    measured_ms: float
    predicted_ms: float
    error_pct: float
    within_target: bool


def emulated_cluster(result: EmulationResult) -> Cluster:
    """The cluster the emulation built, in the model's terms: the tbf rate between hosts.

    Latency per step and per-call overhead are the loopback-gloo preset's (software, measured on
    this machine), since the namespaces add no propagation delay; within a host, gloo over loopback
    (transport gloo) or shared memory (auto: hierarchical).
    """
    c = result.config
    base = preset_cluster("cpu-shm" if c.transport == "auto" else "cpu-loopback-gloo")
    gloo = preset_cluster("cpu-loopback-gloo")
    inter = Link(name=INTER, bandwidth_GBps=c.rate_gbit / 8, latency_us=gloo.inter.latency_us)
    return replace(
        base,
        workers_per_node=c.workers_per_host,
        inter=inter,
        per_message_overhead_us=gloo.per_message_overhead_us,
        name=f"emulated: {c.hosts} hosts x {c.workers_per_host} workers, {c.rate_gbit:g} Gbit/s links",
        source="tbf rate of the emulated links; latency and overhead from the cpu-loopback-gloo preset",
    )


def validate_emulation(
    result: EmulationResult, profile: ModelProfile, *, link_from_run: bool = False
) -> list[EmulationRow]:
    """Predicted vs measured all-reduce times and training step of an emulated cluster run.

    The training step's compute is the profile scaled to the emulation's own bare-model step (all
    workers computing at once), as for the scaling report; the check is of communication and overlap.
    `link_from_run`: the training step is predicted with the link's rate scaled by how far the run's
    largest all-reduce was from the model's (the all-reduce rows themselves stay at the tbf rate).
    """
    c = result.config
    cluster = emulated_cluster(result)
    world = c.hosts * c.workers_per_host
    # gloo runs a ring across all workers; dpscale's hierarchical transport is its own algorithm
    algorithm = "hierarchical" if c.transport == "auto" else "ring"
    rows = []
    for point in result.allreduce:
        # the bench times gloo itself, whatever transport the training used
        cost = all_reduce_cost(
            point["bytes"], world, replace(cluster, intra=preset_cluster("cpu-loopback-gloo").intra), "ring"
        )
        rows.append(
            _emulation_row(
                f"all-reduce {point['bytes'] / 2**20:g} MiB (gloo)",
                point["time_us"] / 1e3,
                cost.seconds * 1e3,
            )
        )
    if link_from_run and rows:
        # the largest message is the one the link's rate decides (latency is a sliver of it)
        largest = max(zip(result.allreduce, rows, strict=True), key=lambda pr: pr[0]["bytes"])[1]
        rate = cluster.inter.bandwidth_GBps * largest.predicted_ms / largest.measured_ms
        cluster = replace(cluster, inter=replace(cluster.inter, bandwidth_GBps=rate))
    prof = profile.at_batch(c.per_worker_batch)
    config = PredictConfig(
        world_sizes=[world],
        per_worker_batch=c.per_worker_batch,
        algorithm=algorithm,
        overlap=c.transport != "auto",
        # the compute level is the slowest rank's measured step: the wait for the slowest worker is
        # in it already, and the profile's step-to-step variation, measured at another time, would
        # count it twice
        terms=ScaleTerms(stragglers=False),
    )
    factor = result.local_step_ms / prof.compute_ms
    (pred,) = predict(profile, cluster, config, contention_by_world_size={world: factor})
    rows.append(
        _emulation_row(
            f"train step, {c.model} batch {c.per_worker_batch} ({result.transport})",
            result.train_step_ms,
            pred.step_ms,
        )
    )
    return rows


def _emulation_row(what: str, measured_ms: float, predicted_ms: float) -> EmulationRow:
    error = 100 * (predicted_ms - measured_ms) / measured_ms
    return EmulationRow(what, measured_ms, predicted_ms, error, abs(error) <= 100 * EMULATION_TARGET)


def format_emulation(rows: list[EmulationRow]) -> str:
    width = max(len(r.what) for r in rows)
    lines = [f"{'':{width}}  {'measured ms':>12}  {'predicted ms':>12}  {'error %':>8}"]
    for r in rows:
        verdict = "ok" if r.within_target else f"MISS (>{EMULATION_TARGET:.0%})"
        lines.append(
            f"{r.what:{width}}  {r.measured_ms:12.2f}  {r.predicted_ms:12.2f}  {r.error_pct:+8.1f}  {verdict}"
        )
    return "\n".join(lines)
