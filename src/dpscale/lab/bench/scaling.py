"""Scaling bench (`dpscale bench scaling`): throughput and scaling efficiency vs workers, per engine.

For each world size one set of ranks is started; every engine is built there from the same seed and
the engines take turns in rounds of a few steps (rotating order, as in lab/bench/engines.py), so drift of a
shared machine hits all alike. A step (zero_grad, forward, loss, backward, optimizer step) is timed
on every rank; its time is the slowest rank's, which is what the next collective waits for.

Figures per (engine, world size N), all from the per-step per-rank times kept in "runs":
    step_ms / step_ms_p90   median / p90 over steps of the slowest rank's step time
    step_ms_p10             p10 of the same (null in reports written before it was kept)
    samples_per_s           global batch / step_ms
    efficiency              samples_per_s(N) / (N * samples_per_s(1)), same engine; null without N=1
    ceiling_fraction        samples_per_s / local engine's samples_per_s at the same N (null without local)
    overhead_ms             step_ms - local engine's step_ms at the same N (null without local)
    comm_ms, exposed_comm_ms  median over steps on rank 0 of the engine's own per-step figures:
                            dpscale's `last_step_stats`; torch DDP's `_get_ddp_logging_data()`
                            (backward_comm_time, less backward_compute_comm_overlap_time for the
                            exposed part), sampled every step; null for local (no communication)
    overlap_pct             100 * (1 - exposed_comm_ms / comm_ms), where comm is measured
    straggler_ms            median over steps of (slowest rank's step time - fastest rank's)

JSON (`ScalingResult.to_dict()`; the `--json` line is the "points" list alone):
    {"config": {"model", "mode", "per_worker_batch", "global_batch", "world_sizes", "engines",
                "steps", "warmup", "threads_per_worker", and launch/hosts.py's HostFlags: "nnodes",
                "rdzv_endpoint", "rdzv_id", "local_addr", "rdzv_conf", "node_rank"},
     "points": [{"engine": str, "transport": str, "model": str, "mode": "weak" | "strong",
                 "world_size": int, "per_worker_batch": int, "global_batch": int, "step_ms": float,
                 "step_ms_p90": float, "samples_per_s": float, "efficiency": float | null,
                 "comm_ms": float | null, "exposed_comm_ms": float | null,
                 "ceiling_fraction": float | null, "overhead_ms": float | null,
                 "overlap_pct": float | null, "straggler_ms": float, "steps": int,
                 "step_ms_p10": float | null, "hosts": int | null}, ...],
     "runs": [{"engine", "world_size", "transport", "step_ms": [[float per rank] per step],
               "comm_ms": [float per step] | null, "exposed_comm_ms": [float per step] | null,
               "hosts": int | null (distinct hosts of the ranks; null in older reports)}, ...]}
Across hosts (`--nnodes H --rdzv-endpoint HOST:PORT --rdzv-id ID ...`, the same command on every
host; launch/hosts.py) each world size N > 1 is one job of H hosts x N/H workers, and every host gets
every rank's times; N = 1, the baseline of efficiency, runs on the store's host only.
`transport` is dpscale's transport name, torch's process-group backend, or "none" for local.
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import asdict, dataclass, field, fields

from dpscale.cores import usable_cores
from dpscale.engine.factory import BENCH_ENGINES, DEFAULT_BENCH_ENGINES
from dpscale.errors import ConfigError
from dpscale.flags import flag_spec, unchecked_config
from dpscale.lab.bench.args import nproc_list_field, parse_name_list
from dpscale.lab.bench.rounds import quantile
from dpscale.lab.bench.scaling_rank import rank_measure
from dpscale.lab.multirank import run_ranks
from dpscale.lab.recipe import TASK_CONVENTION, is_task_spec, load_recipe
from dpscale.launch.hosts import HostFlags, job_nodes, run_ranks_across_hosts
from dpscale.launch.nodes import Nodes
from dpscale.log import get_logger
from dpscale.workloads import WORKLOADS

logger = get_logger(__name__)

MODES = ("weak", "strong")
DEFAULT_PER_WORKER_BATCH = 64


@dataclass(frozen=True, kw_only=True)
class ScalingConfig(HostFlags):
    model: str = field(default="mlp", metadata=flag_spec(help=TASK_CONVENTION))
    """A built-in workload or module:callable returning a Task."""
    mode: str = "weak"
    """weak keeps the per-worker batch fixed, strong the global batch."""
    per_worker_batch: int | None = None
    """Weak mode only (default 64)."""
    global_batch: int | None = None
    """Strong mode only (required): split G/N over N workers."""
    world_sizes: list[int] = nproc_list_field()
    """Comma-separated worker counts, one launch each."""
    engines: list[str] = field(
        default_factory=lambda: list(DEFAULT_BENCH_ENGINES),
        metadata=flag_spec(
            parse=lambda s: parse_name_list(s, flag="--engines", choices=list(BENCH_ENGINES)),
            help=f"comma-separated from {', '.join(BENCH_ENGINES)} "
            f"(default: {','.join(DEFAULT_BENCH_ENGINES)})",
        ),
    )
    """Engines to compare (engine/factory.py's BENCH_ENGINES)."""
    steps: int = 30
    """Timed steps per engine and world size, split in alternating rounds."""
    warmup: int = 3
    """Untimed steps per engine first (allocator, caches, first buckets)."""
    threads_per_worker: int = 1
    """Intra-op threads per worker; N workers use N x this many cores."""

    def __post_init__(self) -> None:
        if not is_task_spec(self.model):
            raise ConfigError(
                f"--model: unknown {self.model!r}; choose from {', '.join(WORKLOADS)} or give module:callable"
            )
        if self.mode not in MODES:
            raise ConfigError(f"--mode: {self.mode!r} is not a mode; choose weak or strong")
        for flag, values in (("--nproc", self.world_sizes), ("--engines", self.engines)):
            if not values or len(set(values)) != len(values):
                raise ConfigError(f"{flag}: give a non-empty list without repeats, got {values}")
        parse_name_list(",".join(self.engines), flag="--engines", choices=list(BENCH_ENGINES))
        if any(n < 1 for n in self.world_sizes):
            raise ConfigError(f"--nproc: every world size must be >= 1, got {self.world_sizes}")
        self.check_hosts(self.world_sizes)
        if self.mode == "weak":
            if self.global_batch is not None:
                raise ConfigError(
                    "--global-batch: only for --mode strong; weak mode fixes --per-worker-batch"
                )
            per_worker = DEFAULT_PER_WORKER_BATCH if self.per_worker_batch is None else self.per_worker_batch
            object.__setattr__(self, "per_worker_batch", per_worker)
            if per_worker < 1:
                raise ConfigError(f"--per-worker-batch: must be >= 1, got {per_worker}")
        else:
            if self.per_worker_batch is not None:
                raise ConfigError(
                    "--per-worker-batch: only for --mode weak; strong mode splits --global-batch"
                )
            if self.global_batch is None or self.global_batch < 1:
                raise ConfigError("--global-batch: --mode strong needs a global batch >= 1, e.g. 128")
            bad = [n for n in self.world_sizes if self.global_batch % n]
            if bad:
                multiple = math.lcm(*self.world_sizes)
                raise ConfigError(
                    f"--global-batch: {self.global_batch} is not divisible by world size {bad[0]}; "
                    f"use a multiple of {multiple}"
                )
        for flag, value, minimum in (
            ("--steps", self.steps, 1),
            ("--warmup", self.warmup, 0),
            ("--threads-per-worker", self.threads_per_worker, 1),
        ):
            if value < minimum:
                raise ConfigError(f"{flag}: must be >= {minimum}, got {value}")

    def batches(self, world_size: int) -> tuple[int, int]:
        """(per-worker batch, global batch) at `world_size`."""
        if self.mode == "weak":
            assert self.per_worker_batch is not None  # __post_init__ sets it in weak mode
            return self.per_worker_batch, self.per_worker_batch * world_size
        assert self.global_batch is not None  # __post_init__ requires it in strong mode
        return self.global_batch // world_size, self.global_batch


@dataclass(frozen=True)
class EngineRun:
    """Raw measurements of one engine at one world size; every figure is computed from these."""

    engine: str
    world_size: int
    transport: str
    step_ms: list[list[float]]  # [step][rank]: wall time of each timed step on each rank
    comm_ms: list[float] | None  # per step, rank 0 (dpscale only)
    exposed_comm_ms: list[float] | None
    hosts: int | None = None  # distinct hosts of the ranks (comm.select.host_id); None in older reports


@dataclass(frozen=True)
class ScalingPoint:
    """One (engine, world size) row; the fields are documented in the module docstring."""

    engine: str
    transport: str
    model: str
    mode: str
    world_size: int
    per_worker_batch: int
    global_batch: int
    step_ms: float
    step_ms_p90: float
    samples_per_s: float
    efficiency: float | None
    comm_ms: float | None
    exposed_comm_ms: float | None
    ceiling_fraction: float | None
    overhead_ms: float | None
    overlap_pct: float | None
    straggler_ms: float
    steps: int
    step_ms_p10: float | None = None  # with a default: older reports' points lack it
    hosts: int | None = None  # distinct hosts the ranks ran on

    @property
    def spread(self) -> float | None:
        """(p90 - p10) / median of the step time: how much the host's load moved the steps."""
        if self.step_ms_p10 is None or not self.step_ms > 0:
            return None
        return (self.step_ms_p90 - self.step_ms_p10) / self.step_ms


POINT_KEYS = tuple(f.name for f in fields(ScalingPoint))  # the documented keys of every point


@dataclass(frozen=True)
class ScalingResult:
    config: ScalingConfig
    points: list[ScalingPoint]
    runs: list[EngineRun]

    def to_dict(self) -> dict:
        return {
            "config": asdict(self.config),
            "points": [asdict(p) for p in self.points],
            "runs": [asdict(r) for r in self.runs],
        }

    @classmethod
    def from_dict(cls, doc: dict) -> ScalingResult:
        """Rebuild from `to_dict()` output (report.json's "results"), e.g. to re-render a report."""
        config = unchecked_config(ScalingConfig, doc["config"])  # its user model need not import now
        runs = [EngineRun(**r) for r in doc["runs"]]
        slowest = {(r.engine, r.world_size): [max(s) for s in r.step_ms] for r in runs}
        points = []
        for p in doc["points"]:
            steps = slowest.get((p["engine"], p["world_size"]))
            if p.get("step_ms_p10") is None and steps:  # an older report: its runs still hold the steps
                p = {**p, "step_ms_p10": quantile(steps, 0.1)}
            points.append(ScalingPoint(**p))
        return cls(config, points, runs)


def run(config: ScalingConfig) -> ScalingResult:
    """Measure every (engine, world size) of `config`; one set of ranks per world size (across
    hosts: one job per world size > 1, and N = 1 on the store's host only; launch/hosts.py)."""
    load_recipe(config.model, check=True)  # a broken task fails here, once, not in every rank
    cores = usable_cores()
    runs, nodes = [], config.nodes()
    for n in config.world_sizes:
        job = job_nodes(nodes, n, "scaling")
        if job is False:  # the one-worker baseline runs on the store's host only
            continue
        assert job is None or isinstance(job, Nodes)
        here = n if job is None else n // job.max_nodes  # this host's workers
        if here * config.threads_per_worker > cores:
            logger.warning(
                "%s x %d thread(s) > %d usable cores; workers time-share cores, so the "
                "figures measure the scheduler as much as the engines",
                f"world size {n}" if job is None else f"{here} workers on this host",
                config.threads_per_worker,
                cores,
            )
        logger.info("scaling: world size %d, engines %s", n, ",".join(config.engines))
        batch, _ = config.batches(n)
        # Generous: a hang still ends (with every rank's stack); a slow shared machine does not.
        timeout_s = 300 + 5 * (config.steps + config.warmup) * len(config.engines)
        args = (config.model, batch, config.engines, config.steps, config.warmup, list(sys.path))
        if job is None:
            per_rank = run_ranks(
                rank_measure, n, *args, threads=config.threads_per_worker, timeout_s=timeout_s
            )
        else:
            per_rank = run_ranks_across_hosts(
                rank_measure, n, *args, nodes=job, threads=config.threads_per_worker, timeout_s=timeout_s
            )
        hosts = len({r["host"] for r in per_rank})
        for e in config.engines:
            step_ms = [list(ts) for ts in zip(*(r["times"][e] for r in per_rank), strict=True)]
            stats = per_rank[0]["comm"][e]  # [(comm_ms, exposed_ms) per step], dpscale only
            comm = [c for c, _ in stats] or None
            exposed = [x for _, x in stats] or None
            runs.append(EngineRun(e, n, per_rank[0]["transport"][e], step_ms, comm, exposed, hosts))
    return ScalingResult(config, summarize(config, runs), runs)


def summarize(config: ScalingConfig, runs: list[EngineRun]) -> list[ScalingPoint]:
    """The figures of every run (see the module docstring), in the order of `runs`."""
    slowest = {(r.engine, r.world_size): [max(s) for s in r.step_ms] for r in runs}
    median = {k: statistics.median(v) for k, v in slowest.items()}
    throughput = {(e, n): config.batches(n)[1] / (m / 1e3) for (e, n), m in median.items()}
    points = []
    for r in runs:
        key, n = (r.engine, r.world_size), r.world_size
        per_worker, global_batch = config.batches(n)
        base, local = throughput.get((r.engine, 1)), ("local", n)
        comm = statistics.median(r.comm_ms) if r.comm_ms else None
        exposed = statistics.median(r.exposed_comm_ms) if r.exposed_comm_ms else None
        points.append(
            ScalingPoint(
                engine=r.engine,
                transport=r.transport,
                model=config.model,
                mode=config.mode,
                world_size=n,
                per_worker_batch=per_worker,
                global_batch=global_batch,
                step_ms=median[key],
                step_ms_p90=quantile(slowest[key], 0.9),
                samples_per_s=throughput[key],
                efficiency=throughput[key] / (n * base) if base else None,
                comm_ms=comm,
                exposed_comm_ms=exposed,
                ceiling_fraction=throughput[key] / throughput[local] if local in throughput else None,
                overhead_ms=median[key] - median[local] if local in median else None,
                # medians of two per-step figures: exposed can exceed comm by rounding; 0% is the floor
                overlap_pct=max(0.0, 100 * (1 - exposed / comm)) if comm and exposed is not None else None,
                straggler_ms=statistics.median(max(s) - min(s) for s in r.step_ms),
                steps=len(r.step_ms),
                step_ms_p10=quantile(slowest[key], 0.1),
                hosts=r.hosts,
            )
        )
    return points
