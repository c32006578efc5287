"""Check the model against a `dpscale bench scaling` report measured on this machine.

For every (engine, world size) point of the report, the step time is predicted from the profile,
the cluster (calibrated per transport from an all-reduce report when one is given) and the engine,
and set against the measured step time.

The compute level never comes from the report being checked. It comes from the profile, measured in
another run (`dpscale profile`, with `--co-located N` for the slowdown of N workers on the node):
compute at N = profile compute x the profile's contention for N workers (1 where it has none). The
report's own `local` engine is then a check like any other row (the model predicts it as the
profile's compute at that contention), not an input. On a shared machine this makes the check
sensitive to load that changed between the two runs; that is the point: a prediction is made before
the run it predicts. An earlier version took the level from the report's local engine
(`--compute-from local`), which let the report calibrate its own prediction.

Measured step time (`statistic`): the report's median (`step_ms`); "pNN", that percentile of the
per-step times in the report's raw runs; or "paired", the local engine's median plus the median
over rounds of (engine's round median - local engine's round median). On a shared machine other
users' load comes in bursts of seconds that double some steps, and a median then depends on which
engine's rounds a burst happened to hit; the engines take turns in rounds of a few steps, so the
paired difference within a round cancels most of a burst, and a low percentile (p25) keeps to the
unloaded machine as long as bursts cover less than a quarter of the steps.

Sync terms: at N > 1 the profile's in-step sync terms for the point's transport (sync.py, measured
by `dpscale profile --co-located N` on the bare model, apart from the report) scale compute and add
a cost per all-reduce call; a profile without them predicts without.

Transports: `shm` (and `hierarchical`) reduce synchronously on the autograd thread, so nothing
overlaps; `gloo` reduces on its own thread, so bucket reductions overlap the rest of backward.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from matplotlib.figure import Figure

from dpscale.lab.bench.report import Image, ReportDir, Section, Table, new_figure, read_report
from dpscale.lab.bench.scaling_rank import split_rounds
from dpscale.lab.predict.cluster import Cluster, calibrated, preset_cluster
from dpscale.lab.predict.model import PredictConfig, predict
from dpscale.lab.predict.profile import ModelProfile

TARGET = 0.15  # the target for world sizes 1 and 2
TARGET_WORLD_SIZES = (1, 2)
# synchronous on the autograd thread: a reduction blocks backward, so no overlap
BLOCKING_TRANSPORTS = ("shm", "hierarchical")
_PRESET_FOR = {"shm": "cpu-shm", "hierarchical": "cpu-shm"}
STATISTIC_RE = re.compile(r"^(median|paired|p\d+(\.\d+)?)$")


@dataclass(frozen=True)
class ValidationRow:
    engine: str
    transport: str
    world_size: int
    measured_step_ms: float
    predicted_step_ms: float
    error_pct: float  # 100 * (predicted - measured) / measured
    role: str  # "check" (every row: nothing of the report goes into its prediction)
    compute_factor: float  # the profile's contention for this many workers on the node
    predicted_comm_ms: float
    predicted_exposed_ms: float
    measured_comm_ms: float | None  # dpscale's own per-step stats, when the report has them
    measured_exposed_ms: float | None
    within_target: bool | None  # None where no target applies (world sizes > 2)


@dataclass(frozen=True)
class ValidationResult:
    scaling_report: str
    calibration: str | None
    statistic: str  # "median", "p25" etc. or "paired": what "measured" means (module docstring)
    profile: dict
    rows: list[ValidationRow]

    def to_dict(self) -> dict:
        return {
            "scaling_report": self.scaling_report,
            "calibration": self.calibration,
            "statistic": self.statistic,
            "profile": self.profile,
            "rows": [asdict(r) for r in self.rows],
        }

    @property
    def checks(self) -> list[ValidationRow]:
        return [r for r in self.rows if r.role == "check"]


def load_scaling_report(report_dir: str | Path, *, flag: str = "scaling_report") -> dict:
    results = read_report(report_dir, flag=flag)["results"]
    if not isinstance(results, dict) or not results.get("points") or "config" not in results:
        raise ValueError(f"{flag}: {report_dir} is not a `dpscale bench scaling` report (no points)")
    missing = {"engine", "transport", "world_size", "per_worker_batch", "step_ms"} - set(results["points"][0])
    if missing:
        raise ValueError(f"{flag}: the report's points lack {', '.join(sorted(missing))}")
    return results


def _quantile(values: list[float], q: float) -> float:
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (pos - lo) * (xs[hi] - xs[lo])


def measured_steps(scaling: dict, statistic: str = "median") -> dict[tuple[str, int], float]:
    """(engine, world size) -> measured step ms by `statistic` (see the module docstring)."""
    if statistic == "median":
        return {(p["engine"], p["world_size"]): p["step_ms"] for p in scaling["points"]}
    if not STATISTIC_RE.match(statistic):
        raise ValueError(f"--statistic: {statistic!r} is not median, paired or a percentile like p25")
    if not scaling.get("runs"):
        raise ValueError(f"--statistic: the scaling report has no raw runs for {statistic}; use median")
    # a step counts at its slowest rank, as in the report's own figures
    slowest = {(r["engine"], r["world_size"]): [max(s) for s in r["step_ms"]] for r in scaling["runs"]}
    if statistic != "paired":
        q = float(statistic[1:]) / 100
        if not 0 <= q <= 1:
            raise ValueError(f"--statistic: a percentile must be p0 to p100, got {statistic}")
        return {k: _quantile(v, q) for k, v in slowest.items()}
    out = {}
    for (engine, n), steps in slowest.items():
        local = slowest.get(("local", n))
        if local is None or len(local) != len(steps):
            out[engine, n] = statistics.median(steps)
            continue
        # the engines share every round (bench/scaling_rank.py): step k of each is in round
        # k // STEPS_PER_ROUND
        deltas = [
            statistics.median(e) - statistics.median(b)
            for e, b in zip(split_rounds(steps), split_rounds(local), strict=True)
        ]
        out[engine, n] = statistics.median(local) + statistics.median(deltas)
    return out


def _cluster_for(transport: str, world_size: int, allreduce: dict | None) -> Cluster:
    base = preset_cluster(_PRESET_FOR.get(transport, "cpu-loopback-gloo"))
    base = replace(base, workers_per_node=max(world_size, 1))  # every worker on this one host
    if allreduce is None:
        return base
    if any(p["transport"] == transport for p in allreduce["points"]):
        return calibrated(base, allreduce, transport)
    raise ValueError(
        f"--calibrate: the all-reduce report has no {transport!r} points; run "
        f"`dpscale bench allreduce --transport {transport}` for it"
    )


def validate(
    scaling: dict,
    profile: ModelProfile,
    *,
    allreduce: dict | None = None,
    scaling_report: str = "",
    calibration: str | None = None,
    statistic: str = "median",
) -> ValidationResult:
    """Predicted vs measured step time for every point of a scaling report's results."""
    steps = measured_steps(scaling, statistic)
    rows = []
    for p in scaling["points"]:
        n, batch, engine, transport = p["world_size"], p["per_worker_batch"], p["engine"], p["transport"]
        prof = profile.at_batch(batch)
        measured_ms = steps[(engine, n)]
        factor = prof.contention.get(n, 1.0) if n > 1 else 1.0
        if engine == "local":
            pred_ms, comm, exposed = prof.compute_ms * factor, 0.0, 0.0
        else:
            cluster = _cluster_for(transport, n, allreduce)
            config = PredictConfig(
                world_sizes=[n],
                per_worker_batch=batch,
                engine=_profiled_engine(engine, profile),
                overlap=transport not in BLOCKING_TRANSPORTS,
                sync_transport=transport,
            )
            (pred,) = predict(profile, cluster, config, contention_by_world_size={n: factor})
            pred_ms, comm, exposed = pred.step_ms, pred.comm_ms, pred.exposed_comm_ms
        error = 100 * (pred_ms - measured_ms) / measured_ms
        role = "check"
        within = abs(error) <= 100 * TARGET if n in TARGET_WORLD_SIZES else None
        rows.append(
            ValidationRow(
                engine=engine,
                transport=transport,
                world_size=n,
                measured_step_ms=measured_ms,
                predicted_step_ms=pred_ms,
                error_pct=error,
                role=role,
                compute_factor=factor,
                predicted_comm_ms=comm,
                predicted_exposed_ms=exposed,
                measured_comm_ms=p.get("comm_ms"),
                measured_exposed_ms=p.get("exposed_comm_ms"),
                within_target=within,
            )
        )
    summary = {k: v for k, v in profile.to_dict().items() if k not in ("params", "system")}
    return ValidationResult(scaling_report, calibration, statistic, summary, rows)


def _profiled_engine(engine: str, profile: ModelProfile) -> str:
    """Whose one-worker overhead the profile has for `engine`: dpscale-gloo is dpscale's engine."""
    base = "dpscale" if engine.startswith("dpscale") else engine
    return base if base in profile.engine_overhead_ms else "none"


_COLUMNS = {
    "engine": ("engine", ""),
    "transport": ("transport", ""),
    "world_size": ("N", "d"),
    "measured_step_ms": ("measured ms", ".2f"),
    "predicted_step_ms": ("predicted ms", ".2f"),
    "error_pct": ("error %", "+.1f"),
    "compute_factor": ("compute x", ".2f"),
    "predicted_comm_ms": ("pred comm", ".2f"),
    "measured_comm_ms": ("meas comm", ".2f"),
    "predicted_exposed_ms": ("pred exposed", ".2f"),
    "measured_exposed_ms": ("meas exposed", ".2f"),
    "role": ("role", ""),
}


def _verdict(r: ValidationRow) -> str:
    if r.within_target is None:
        return r.role
    return "ok" if r.within_target else f"MISS (>{TARGET:.0%})"


def format_table(result: ValidationResult) -> str:
    def cell(r: ValidationRow, c: str) -> str:
        if c == "role":
            return _verdict(r)
        v = getattr(r, c)
        return "-" if v is None else format(v, _COLUMNS[c][1])

    rows = [{c: cell(r, c) for c in _COLUMNS} for r in result.rows]
    widths = {c: max(len(h), *(len(r[c]) for r in rows)) for c, (h, _) in _COLUMNS.items()}
    text = ("engine", "transport", "role")

    def line(cells: dict[str, str]) -> str:
        cols = (cells[c].ljust(widths[c]) if c in text else cells[c].rjust(widths[c]) for c in _COLUMNS)
        return "  ".join(cols).rstrip()

    checks = result.checks
    worst = max((abs(r.error_pct) for r in checks), default=0.0)
    hits = sum(1 for r in checks if r.within_target)
    targeted = sum(1 for r in checks if r.within_target is not None)
    foot = (
        f"measured = {result.statistic} step time, compute from the profile (another run); "
        f"checks: {hits}/{targeted} within {TARGET:.0%} at "
        f"world sizes 1-2; largest error {worst:.1f}%"
    )
    return "\n".join([line({c: h for c, (h, _) in _COLUMNS.items()}), *(line(r) for r in rows), foot])


def plot(result: ValidationResult) -> Figure:
    """Predicted vs measured step time; the band is the +-15% target."""
    fig = new_figure(6.5, 5.5)
    ax = fig.add_subplot()
    top = 1.15 * max(max(r.measured_step_ms, r.predicted_step_ms) for r in result.rows)
    ax.plot([0, top], [0, top], color="gray", lw=1)
    ax.fill_between([0, top], [0, top * (1 - TARGET)], [0, top * (1 + TARGET)], color="gray", alpha=0.15)
    for r in result.rows:
        ax.scatter(r.measured_step_ms, r.predicted_step_ms, marker="o", s=45)
        ax.annotate(f"{r.engine}/{r.transport} N={r.world_size}", (r.measured_step_ms, r.predicted_step_ms),
                    textcoords="offset points", xytext=(5, -3), fontsize="x-small")  # fmt: skip
    ax.set(xlim=(0, top), ylim=(0, top), xlabel="measured step (ms)", ylabel="predicted step (ms)")
    ax.set_title(f"Predicted vs measured step time (band: +-{TARGET:.0%})")
    ax.grid(True, alpha=0.35)
    return fig


def write_report(result: ValidationResult, report: ReportDir) -> None:
    doc = result.to_dict()
    report.write_json(
        doc, config={"scaling_report": result.scaling_report, "calibration": result.calibration}
    )
    report.write_csv("validation", doc["rows"])
    report.save_figure(plot(result), "validation")
    method = (
        f"Scaling report: {result.scaling_report}. "
        f"Calibration: {result.calibration or 'presets (no --calibrate)'}. "
        f"Measured = {result.statistic} of the per-step times (slowest rank; see --statistic). "
        "Compute of each point = the profile's compute (measured in another run) x its lockstep "
        "contention for N workers; nothing of the report goes into the prediction. "
        "shm reduces inline (no overlap); gloo overlaps."
    )
    fmt = {c: f for c, (_, f) in _COLUMNS.items() if f}
    heads = {c: h for c, (h, _) in _COLUMNS.items()}
    rows = [{**asdict(r), "role": _verdict(r)} for r in result.rows]
    report.write_markdown(
        "Prediction vs measurement",
        [
            Section("Results", [method, Table(rows, list(_COLUMNS), fmt, heads)]),
            Section("Plot", [Image("validation.png", "predicted vs measured step time")]),
        ],
    )
