"""The model against an emulated multi-host cluster (emulate.py): all-reduce times and a training step.

The cluster is described to the model with the figures the emulation enforces: the tbf rate
between hosts. Compute is not taken on trust, as in validate.py: the training step's compute is the
profile scaled to the emulation's own bare-model step (every worker computing at once), so what is
checked is communication and overlap. Target: within 20%.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dpscale.predict.cluster import INTER, Cluster, Link, preset_cluster
from dpscale.predict.costs import all_reduce_cost
from dpscale.predict.model import PredictConfig, predict
from dpscale.predict.profile import ModelProfile
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


def validate_emulation(result: EmulationResult, profile: ModelProfile) -> list[EmulationRow]:
    """Predicted vs measured all-reduce times and training step of an emulated cluster run.

    The training step's compute is the profile scaled to the emulation's own bare-model step (all
    workers computing at once), as for the scaling report; the check is of communication and overlap.
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
    prof = profile.at_batch(c.per_worker_batch)
    config = PredictConfig(
        world_sizes=[world],
        per_worker_batch=c.per_worker_batch,
        algorithm=algorithm,
        overlap=c.transport != "auto",
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
