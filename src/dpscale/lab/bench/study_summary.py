"""The study's summary table: one row per (model, engine, world size) that one of its benches ran.

Every figure in a row was measured for that row: the weak-scaling figures for the (model, engine,
N) the scaling bench ran, the all-reduce bus bandwidth of that row's transport at that N, the
convergence gap for the (workload, engine, N) the convergence bench trained, the time to target
and statistical efficiency for the (workload, engine, N) `bench convergence --mode weak` trained.
Nothing is copied from one row to another; a figure the study did not measure for a row is None,
shown "n/m" (not measured; for time to target "not trained", or "not reached" when the run missed
it), and one that cannot exist for it (bandwidth at N = 1, communication of `local`) "-".

Row keys (the study's report.json "summary", documented JSON):
    model, engine, transport (null where the bench does not record it), world_size,
    samples_per_s, efficiency, spread ((p10-p90)/median of the step time), exposed_comm_ms,
    overhead_ms, busbw_GBps (all-reduce at the largest swept size), convergence_gap
    (max_rel_gap at N against the smallest N; 0 at the smallest N, the reference),
    time_to_target_s, statistical_efficiency (samples to target at N=1 / at N, same engine),
    convergence_target (e.g. "train loss <= 1"), convergence_status ("reached", "not reached",
    or null: not trained for this row)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dpscale.lab.bench.allreduce import AllReduceResult
from dpscale.lab.bench.convergence import ConvergenceResult
from dpscale.lab.bench.report import CellFormat, text_table
from dpscale.lab.bench.scaling import ScalingResult
from dpscale.lab.bench.weak import WeakResult
from dpscale.train.config import EngineConfig

COLUMNS = [
    "model",
    "engine",
    "transport",
    "world_size",
    "samples_per_s",
    "efficiency",
    "spread",
    "exposed_comm_ms",
    "overhead_ms",
    "busbw_GBps",
    "convergence_gap",
    "time_to_target_s",
    "statistical_efficiency",
]
# row keys beside the table's columns: what the time-to-target cells rest on
TARGET_KEYS = ["convergence_target", "convergence_status"]
HEADERS = {
    "world_size": "N",
    "samples_per_s": "samples/s",
    "spread": "spread p10-p90",
    "exposed_comm_ms": "exposed comm ms",
    "overhead_ms": "overhead ms",
    "busbw_GBps": "all-reduce busbw GB/s (largest size)",
    "convergence_gap": "convergence gap",
    "time_to_target_s": "time to target s",
    "statistical_efficiency": "statistical efficiency",
}
NOT_TRAINED = "not trained"
NOT_MEASURED = "n/m"
READING = (
    "One row per (model, engine, N) a bench ran; every figure is that row's own measurement, "
    f"'{NOT_MEASURED}' = not measured for this row, '-' = cannot exist for it. "
    "efficiency = throughput at N workers / (N x throughput of the same engine at 1 worker); "
    "spread = (p90 - p10) / median of the step time (above 20%: the load moved during the run); "
    "exposed comm = communication not hidden behind compute, as the engine reports it (dpscale's "
    "reducer; torch DDP's _get_ddp_logging_data()); overhead = step time minus the unsynchronized "
    "`local` engine's at the same N (everything synchronization costs); all-reduce busbw at the "
    "largest swept size for the row's transport; convergence gap = largest relative gap between the "
    "loss curves at N and at the smallest N (same global batch, accumulation makes up the difference), "
    "for the workload and engine the convergence bench trained; time to target and statistical "
    "efficiency from training this row's model with this row's engine at this N, the global batch "
    "growing with N (sqrt learning-rate rule; statistical efficiency = samples to the target at N=1 "
    f"/ at N, same engine), '{NOT_TRAINED}' where that run was not made (the unsynchronized engine "
    "cannot train; the mlp has no target; --quick trains dpscale's engine only)."
)


def _row(model: str, engine: str, world_size: int) -> dict:
    return dict.fromkeys(COLUMNS + TARGET_KEYS) | {"model": model, "engine": engine, "world_size": world_size}


def summary_rows(
    allreduce: AllReduceResult,
    scaling: Sequence[ScalingResult],
    convergence: ConvergenceResult,
    weak: Sequence[WeakResult] = (),
) -> list[dict]:
    """The rows: the weak-scaling points in their order, then the convergence and time-to-target
    runs no point matches."""
    largest = max(q.bytes for q in allreduce.points)
    # world size 1 moves nothing between ranks: no bandwidth to show
    busbw = {
        (p.transport, p.world_size): p.busbw_GBps
        for p in allreduce.points
        if p.bytes == largest and p.world_size > 1
    }
    rows: dict[tuple[str, str, int], dict] = {}
    for res in scaling:
        for p in res.points:
            rows[(p.model, p.engine, p.world_size)] = _row(p.model, p.engine, p.world_size) | {
                "transport": p.transport,
                "samples_per_s": p.samples_per_s,
                "efficiency": p.efficiency,
                "spread": p.spread,
                "exposed_comm_ms": p.exposed_comm_ms,
                "overhead_ms": p.overhead_ms,
                "busbw_GBps": busbw.get((p.transport, p.world_size)),
            }
    # `bench convergence` trains through the Trainer with its default engine unless it says otherwise
    engine = getattr(convergence.config, "engine", EngineConfig.name)
    for r in convergence.runs:
        key = (convergence.config.workload, engine, r.world_size)
        rows.setdefault(key, _row(*key))["convergence_gap"] = r.max_rel_gap
    for weak_res in weak:
        for run in weak_res.runs:
            key = (weak_res.config.workload, weak_res.config.engine, run.world_size)
            rows.setdefault(key, _row(*key)).update(
                time_to_target_s=run.time_to_target_s,
                statistical_efficiency=weak_res.ratios(run)["statistical_efficiency"],
                convergence_target=weak_res.target_text,
                convergence_status="reached" if run.reached else "not reached",
            )
    return list(rows.values())


def missing_text(row: Mapping[str, object], column: str) -> str:
    """What a None cell means: "-" where the figure cannot exist for the row, else not measured."""
    if column == "transport":
        return "-"
    if column in ("time_to_target_s", "statistical_efficiency"):
        return str(row.get("convergence_status") or NOT_TRAINED)  # "not reached" or "not trained"
    no_link = row.get("world_size") == 1 or row.get("engine") == "local"
    if (column == "busbw_GBps" and no_link) or (column == "exposed_comm_ms" and row.get("engine") == "local"):
        return "-"
    return NOT_MEASURED


def _pct(x: float) -> str:
    return f"{x:.1%}"


FORMATS: dict[str, CellFormat] = {
    "samples_per_s": ",.0f",
    "efficiency": _pct,
    "spread": lambda x: f"{x:.0%}",
    "exposed_comm_ms": ".2f",
    "overhead_ms": ".2f",
    "busbw_GBps": ".3g",
    "convergence_gap": _pct,
    "time_to_target_s": ".2f",
    "statistical_efficiency": ".2f",
}


def format_summary(rows: Sequence[Mapping[str, object]]) -> str:
    """The summary as a fixed-width terminal table (the report's markdown table, same cells)."""
    return text_table(rows, COLUMNS, FORMATS, HEADERS, missing_text)
