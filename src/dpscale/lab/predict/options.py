"""`PredictOptions`: what `dpscale predict` is asked, one field per flag (the flags are generated from it).

The model (a profile file, a model to profile now, or explicit numbers), the cluster (a preset and
flags overriding it, or a calibration), the at-scale terms (each can be switched off) and the
goodput question. Fields that combine (one model source, --nodes or --world-sizes) are checked
where they are combined, in cli/predict.py, with the flag named.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dpscale.flags import flag_spec
from dpscale.lab.predict.cluster import CLUSTER_PRESETS, LINK_PRESETS
from dpscale.lab.predict.costs import ALGORITHM_CHOICES
from dpscale.lab.predict.model import ENGINE_CHOICES

# the per-worker batch of a profile measured now, when none is given
DEFAULT_BATCH = 64

MODEL = "model (one of: --profile, --model, or the explicit numbers)"
CLUSTER = "cluster (a preset, flags overriding it, or a calibration)"
TERMS = "at-scale terms (docs/performance-model.md; each can be switched off)"
GOODPUT = "goodput (time to a target; predict/goodput.py)"
_PRESETS = ", ".join([*CLUSTER_PRESETS, *LINK_PRESETS])


def _in(group: str, help: str | None = None) -> dict:
    return flag_spec(group=group, help=help)


@dataclass(frozen=True, kw_only=True)
class PredictOptions:
    """`dpscale predict`'s flags (besides --json and --report-dir, which only say how to show it)."""

    profile: str | None = field(default=None, metadata=_in(MODEL))
    """a `dpscale profile` JSON file"""
    model: str | None = field(default=None, metadata=_in(MODEL))
    """a built-in workload or module:callable (a Task), profiled now on one worker"""
    from_scale: str | None = field(default=None, metadata=_in(MODEL))
    """a `dpscale scale` (or bench scaling) report of your job: compute and the local link from it"""
    params: float | None = field(default=None, metadata=_in(MODEL))
    """explicit: parameter count (e.g. 25.6e6)"""
    bytes_per_param: float = field(default=4.0, metadata=_in(MODEL))
    """explicit: gradient bytes each (default 4)"""
    step_compute_ms: float | None = field(default=None, metadata=_in(MODEL))
    """explicit: one worker's step, ms"""
    backward_fraction: float = field(default=2 / 3, metadata=_in(MODEL))
    """explicit: share of backward (default 2/3)"""
    per_worker_batch: int | None = field(
        default=None, metadata=flag_spec(help=f"default: the profile's ({DEFAULT_BATCH} otherwise)")
    )
    preset: str = field(
        default="cpu-shm",
        metadata=_in(CLUSTER, f"{_PRESETS}, or INTRA+INTER, e.g. pcie3-x16+8xib-hdr200"),
    )
    workers_per_node: int | None = field(default=None, metadata=_in(CLUSTER))
    """default: the preset's"""
    nodes: int | None = field(default=None, metadata=_in(CLUSTER))
    """one world size: nodes x workers per node"""
    intra_bw_GBps: float | None = field(default=None, metadata=_in(CLUSTER))
    """intra-node bandwidth per direction, GB/s"""
    intra_lat_us: float | None = field(default=None, metadata=_in(CLUSTER))
    """intra-node latency per step, us"""
    intra_efficiency: float | None = field(default=None, metadata=_in(CLUSTER))
    """achieved / nominal intra-node rate (calibrate)"""
    inter_efficiency: float | None = field(default=None, metadata=_in(CLUSTER))
    """achieved / nominal inter-node rate (calibrate)"""
    inter_bw_Gbps: float | None = field(default=None, metadata=_in(CLUSTER))
    """inter-node bandwidth per node, Gbit/s"""
    inter_lat_us: float | None = field(default=None, metadata=_in(CLUSTER))
    """inter-node latency per step, us"""
    per_message_overhead_us: float | None = field(default=None, metadata=_in(CLUSTER))
    """software cost per call, us"""
    calibrate: str | None = field(default=None, metadata=_in(CLUSTER))
    """a `dpscale bench allreduce` report directory"""
    transport: str | None = field(default=None, metadata=_in(CLUSTER))
    """which transport of --calibrate (default shm, else first)"""
    no_nvls: bool = field(default=False, metadata=_in(CLUSTER))
    """no in-switch reduction on NVSwitch (NVLink SHARP), as NCCL_NVLS_ENABLE=0"""
    no_sharp: bool = field(default=False, metadata=_in(CLUSTER))
    """no in-network reduction on the InfiniBand fabric (SHARP), where the preset has it"""
    calibrate_from: str | None = field(default=None, metadata=_in(CLUSTER))
    """comma-separated all_reduce_perf outputs (nccl-tests) or bench allreduce reports, one per node count"""
    world_sizes: str | None = None
    """comma-separated (default 1,2,4,... up to 1024)"""
    bucket_mb: float = 25.0
    """bucket cap in MiB (default 25; the first is 1)"""
    algorithm: str = field(
        default="auto",
        metadata=flag_spec(help=f"{', '.join(ALGORITHM_CHOICES)} (default auto: fastest per size)"),
    )
    no_overlap: bool = False
    """reduce only after backward has finished"""
    compression: float = 1.0
    """gradient bytes / bytes on the wire (2 = fp16)"""
    engine: str = field(
        default="dpscale",
        metadata=flag_spec(help=f"whose measured overhead to add: {', '.join(ENGINE_CHOICES)}"),
    )
    contention: float | None = None
    """compute slowdown when workers share a node (default: the profile's --co-located, else 1)"""
    no_stragglers: bool = field(default=False, metadata=_in(TERMS))
    """no waiting for the slowest worker"""
    compute_cv: float | None = field(default=None, metadata=_in(TERMS))
    """std/mean of a worker's step compute (default: the profile's, else the preset's)"""
    compute_tail: float | None = field(default=None, metadata=_in(TERMS))
    """or: p99/median of it (Gaussian)"""
    node_cv: float | None = field(default=None, metadata=_in(TERMS))
    """std/mean of the delay a node's host and network add to its workers (default: the preset's)"""
    no_achieved_bandwidth: bool = field(default=False, metadata=_in(TERMS))
    """links at their nominal rate"""
    no_congestion: bool = field(default=False, metadata=_in(TERMS))
    """no oversubscription or flow collisions"""
    oversubscription: float = field(default=1.0, metadata=_in(TERMS))
    """fabric uplink ratio (2 = 2:1)"""
    nodes_per_switch: int | None = field(default=None, metadata=_in(TERMS))
    """nodes non-blocking below one switch"""
    congestion_per_doubling: float | None = field(default=None, metadata=_in(TERMS))
    """inter-node bandwidth lost per doubling of the nodes (default: the preset's)"""
    no_interference: bool = field(default=False, metadata=_in(TERMS))
    """backward not slowed by reductions"""
    interference: float | None = field(default=None, metadata=_in(TERMS))
    """backward slowdown per ms of communication it hides (default: the preset's)"""
    data_workers: int | None = field(default=None, metadata=_in(TERMS))
    """loader processes per worker, as train's (with a measured profile's input rate; 0: in the loop)"""
    input_samples_per_s: float | None = field(default=None, metadata=_in(TERMS))
    """samples/s a node's host input pipeline delivers, all its workers together (default: no limit)"""
    no_input_pipeline: bool = field(default=False, metadata=_in(TERMS))
    """the host feeds any demand (ignore --input-samples-per-s)"""
    goodput: bool = field(default=False, metadata=_in(GOODPUT))
    """rank (workers, global batch) by predicted time to target"""
    noise_scale: str | None = field(default=None, metadata=_in(GOODPUT))
    """B_simple in samples, a `dpscale train --json` summary file, or a metrics.jsonl (its last gns)"""
    target_steps: float | None = field(default=None, metadata=_in(GOODPUT))
    """steps a run took to the target (default: the run's)"""
    target_batch: int | None = field(default=None, metadata=_in(GOODPUT))
    """that run's global batch (default: the run's)"""
    per_worker_batches: str | None = field(default=None, metadata=_in(GOODPUT))
    """comma-separated (default: the per-worker batch alone)"""
