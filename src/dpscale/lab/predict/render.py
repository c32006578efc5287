"""Show a prediction: terminal table, efficiency/throughput plot, and a report directory like the benches'.

reports/<UTC>-predict/
    report.json   results = {"config", "cluster", "profile", "predictions": [...]} (see `result_doc`)
    predict.csv   one row per world size (the documented JSON keys and the algorithms used)
    predict.png   efficiency and throughput vs workers, log2 x axis
    report.md     inputs with their sources, the table, the plot
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

from dpscale.errors import import_extra
from dpscale.lab.bench.bench import Figures
from dpscale.lab.bench.report import CellFormat, Image, ReportDir, Section, Table, new_figure, text_table
from dpscale.lab.predict.cluster import Cluster, Link, MeasuredAllReduce
from dpscale.lab.predict.compression_cost import CompressionCost
from dpscale.lab.predict.degrade import ScaleTerms
from dpscale.lab.predict.error_band import error_band
from dpscale.lab.predict.model import BAND_KEYS, JSON_KEYS, PredictConfig, Prediction
from dpscale.lab.predict.profile import ModelProfile
from dpscale.lab.predict.timeline import BucketSpan

if TYPE_CHECKING:  # matplotlib: the lab extra, imported when a plot is drawn
    from matplotlib.figure import Figure


def _rate(samples_per_s: float) -> str:
    """Samples/s as a plain number: 2,421,000 beside 2,560 (".4g" wrote 2.421e+06 there)."""
    v = float(samples_per_s)
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


_COLUMNS: dict[str, tuple[str, CellFormat]] = {  # key: (header, format)
    "world_size": ("N", "d"),
    "nodes": ("nodes", "d"),
    "step_ms": ("step ms", ".2f"),
    "compute_ms": ("compute ms", ".2f"),
    "comm_ms": ("comm ms", ".2f"),
    "exposed_comm_ms": ("exposed ms", ".2f"),
    "samples_per_s": ("samples/s", _rate),
    "efficiency": ("efficiency (band)", ""),  # _table_row: "87.1% (77-89)"
    "algorithms": ("algorithm", ""),
    "bottleneck": ("bottleneck", ""),
}


def profile_summary(profile: ModelProfile) -> str:
    overhead = ", ".join(f"{e} {ms:.2f} ms" for e, ms in profile.engine_overhead_ms.items()) or "not measured"
    threads = f", {profile.threads} intra-op thread(s)" if profile.threads else ""
    contention = "".join(
        f"; {k} workers in lockstep compute {v:.2f}x slower" for k, v in profile.contention.items()
    )
    if profile.compute_cv is not None:
        contention += f"; step-to-step compute variation {profile.compute_cv:.3f}"
    if profile.input_samples_per_s is not None:
        contention += f"; input {profile.input_samples_per_s:,.0f} samples/s in one process"
    if profile.interference is not None:
        contention += f"; overlap interference {profile.interference:.2f} ms per ms of hidden reduction"
    return (
        f"{profile.model} ({profile.source}{threads}), batch {profile.per_worker_batch}/worker: forward "
        f"{profile.forward_ms:.2f} ms, backward {profile.backward_ms:.2f} ms, "
        f"optimizer {profile.optimizer_ms:.2f} ms; "
        f"{profile.param_count:,} parameters, {profile.param_bytes / 2**20:.1f} MiB of gradients; "
        f"engine overhead at one worker: {overhead}{contention}"
    )


def efficiency_text(p: Prediction) -> str:
    """The efficiency with its error band (error_band.py): "87.1% (77-89)"; one worker: "100.0%"."""
    if p.world_size == 1:
        return f"{p.efficiency:.1%}"
    return f"{p.efficiency:.1%} ({100 * p.efficiency_low:.0f}-{100 * p.efficiency_high:.0f})"


def _table_row(p: Prediction) -> dict:
    return {**p.to_dict(), "algorithms": p.algorithms, "efficiency": efficiency_text(p)}


def format_table(predictions: Sequence[Prediction]) -> str:
    """The predictions as a fixed-width terminal table (the report's table, same cells)."""
    rows = [_table_row(p) for p in predictions]
    formats = {c: f for c, (_, f) in _COLUMNS.items() if f}
    return text_table(rows, list(_COLUMNS), formats, {c: h for c, (h, _) in _COLUMNS.items()})


def _workers_axis(ax, sizes: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(sizes))
    while len(ticks) > 12:
        ticks = ticks[::2]
    ax.set_xticks(ticks, [str(n) for n in ticks])
    ax.xaxis.set_minor_locator(import_extra("matplotlib.ticker", "drawing a plot").NullLocator())
    ax.set_xlabel("workers N (log scale)")
    ax.grid(True, alpha=0.35)


def plot(predictions: Sequence[Prediction], title: str) -> Figure:
    """Efficiency (left) and throughput with the linear ideal (right) vs workers, log2 x axis."""
    fig = new_figure(11.0, 4.5)
    eff_ax, thr_ax = fig.subplots(1, 2)
    ns = [p.world_size for p in predictions]
    line = eff_ax.plot(ns, [100 * p.efficiency for p in predictions], marker="o", lw=2, label="predicted")
    band = error_band()
    eff_ax.fill_between(
        ns,
        [100 * p.efficiency_low for p in predictions],
        [100 * p.efficiency_high for p in predictions],
        color=line[0].get_color(), alpha=0.2, lw=0,
        label=f"band: every held-out error ({band.coverage:.0%} for a new case)",
    )  # fmt: skip
    eff_ax.axhline(100, color="gray", ls="--", lw=1, label="linear scaling")
    eff_ax.set(ylabel="scaling efficiency (%)", title="Efficiency vs workers")
    eff_ax.set_ylim(0, max(110, *(105 * p.efficiency for p in predictions)))
    thr_ax.plot(ns, [p.samples_per_s for p in predictions], marker="o", lw=2, label="predicted")
    one = predictions[0].samples_per_s / predictions[0].world_size / predictions[0].efficiency
    thr_ax.plot(ns, [n * one for n in ns], color="gray", ls="--", lw=1, label="N x one worker")
    thr_ax.set(yscale="log", ylabel="throughput (samples/s)", title="Throughput vs workers")
    for ax, where in ((eff_ax, "lower left"), (thr_ax, "upper left")):
        _workers_axis(ax, ns)
        ax.legend(loc=where, fontsize="small")
    # where the bottleneck changes, say so below the efficiency curve (above it lie the 100% line
    # and the title), wrapped, and leaning away from the nearer edge of the plot
    last = None
    for i, p in enumerate(predictions):
        if p.bottleneck != last:
            eff_ax.annotate(
                textwrap.fill(p.bottleneck, 24), (p.world_size, 100 * p.efficiency),
                textcoords="offset points", xytext=(6, -26), va="top", fontsize="x-small",
                ha="left" if i < len(predictions) / 2 else "right",
                arrowprops=dict(arrowstyle="-", color="gray", lw=0.5),
            )  # fmt: skip
            last = p.bottleneck
    fig.suptitle(title)
    return fig


def result_doc(
    predictions: Sequence[Prediction], profile: ModelProfile, cluster: Cluster, config: PredictConfig
) -> dict:
    """report.json's results: everything needed to re-render or to compare later."""
    prof = profile.to_dict()
    prof.pop("params")  # per-parameter timings are in the profile file, not needed here
    clus = asdict(cluster)
    clus["measured"] = {str(n): asdict(m) for n, m in cluster.measured.items()}
    return {
        "config": asdict(config),
        "cluster": clus,
        "profile": prof,
        "predictions": [
            {
                **p.to_dict(),
                "algorithms": p.algorithms,
                "terms_ms": p.terms_ms,
                "losses_ms": p.losses_ms,
                "buckets": [asdict(s) for s in p.spans],
            }
            for p in predictions
        ],
    }


def results_from_doc(doc: dict) -> tuple[list[Prediction], ModelProfile, Cluster, PredictConfig]:
    """The inverse of `result_doc`: what `write_report` takes, from report.json's results."""
    clus = dict(doc["cluster"])
    clus["intra"], clus["inter"] = Link(**clus["intra"]), Link(**clus["inter"])
    clus["measured"] = {
        int(n): MeasuredAllReduce(
            **{**m, "sizes_bytes": tuple(m["sizes_bytes"]), "times_us": tuple(m["times_us"])}
        )
        for n, m in clus["measured"].items()  # JSON keys are str
    }
    cast = doc["config"].get("compression_cost")
    config = PredictConfig(
        **{
            **doc["config"],
            "terms": ScaleTerms(**doc["config"]["terms"]),
            "compression_cost": CompressionCost.from_dict(cast) if cast else None,
        }
    )
    predictions = [
        Prediction(
            **{k: p[k] for k in JSON_KEYS if k not in BAND_KEYS},
            algorithms=p["algorithms"],
            terms_ms=p["terms_ms"],
            losses_ms=p["losses_ms"],
            spans=tuple(BucketSpan(**b) for b in p["buckets"]),
        )
        for p in doc["predictions"]
    ]
    return predictions, ModelProfile.from_dict(doc["profile"]), Cluster(**clus), config


def write_report(
    report: ReportDir,
    predictions: Sequence[Prediction],
    profile: ModelProfile,
    cluster: Cluster,
    config: PredictConfig,
) -> None:
    doc = result_doc(predictions, profile, cluster, config)
    report.write_json(doc, config=doc["config"])
    report.write_csv("predict", [{**p.to_dict(), "algorithms": p.algorithms} for p in predictions])
    batch = config.per_worker_batch or profile.per_worker_batch
    title = f"{profile.model}, batch {batch}/worker, on {cluster.name}"
    report.save_figure(plot(predictions, title), "predict")
    overlap = "on" if config.overlap else "off"
    inputs = [
        f"- **Profile:** {profile_summary(profile)}",
        f"- **Cluster:** {cluster.describe()}",
        f"- **Sources:** {cluster.source or 'flags given on the command line'}",
        f"- **Options:** buckets {config.bucket_mb:g} MiB (first {config.first_bucket():g} MiB), "
        f"overlap {overlap}, "
        f"compression {config.compression:g}x, algorithm {config.algorithm}, engine {config.engine}, "
        f"contention {'from the profile' if config.contention is None else f'{config.contention:g}x'}, "
        f"input pipeline {_input_text(cluster, config)}",
    ]
    method = (
        "Step = compute + communication left exposed after backward (or, when longer, the time the node's "
        "host takes to prepare its workers' samples); each bucket's all-reduce starts when "
        "the bucket is ready and the previous one is done. Efficiency = throughput / (N x one-worker "
        "throughput with no communication). Formulas and sources: docs/performance-model.md. "
        f"In brackets, the error band: {error_band().describe()} (docs/predict.md)."
    )
    fmt = {c: f for c, (_, f) in _COLUMNS.items() if f}
    heads = {c: h for c, (h, _) in _COLUMNS.items()}
    rows = [_table_row(p) for p in predictions]
    report.write_markdown(
        "Scaling prediction",
        [
            Section("Inputs", ["\n".join(inputs)]),
            Section("Prediction", [method, Table(rows, list(_COLUMNS), fmt, heads)]),
            Section("Where the step goes", [_LOSSES_TEXT, losses_table(predictions)]),
            Section("Plot", [Image("predict.png", "efficiency and throughput vs workers")]),
        ],
    )


_LOSSES_TEXT = (
    "What each term adds to the step beyond one worker's compute, ms (exposed communication shared "
    "out over its terms; stragglers; overlap interference; waiting for the host's input pipeline); the "
    "largest names the bottleneck. Switch one off (--no-stragglers, --no-achieved-bandwidth, "
    "--no-congestion, --no-interference, --no-input-pipeline) to see its effect on efficiency. See "
    "docs/performance-model.md, At-scale terms."
)


def _input_text(cluster: Cluster, config: PredictConfig) -> str:
    """How the input pipeline was modelled, in words (model.py: `_input`)."""
    terms = config.terms
    if not terms.input_pipeline:
        return "off"
    rate = terms.input_samples_per_s or cluster.input_samples_per_s
    if rate is not None:
        return f"{rate:,.0f} samples/s per node"
    if config.data_workers == 0:
        return "loaded in each worker's own loop, at the profile's rate"
    if config.data_workers is not None:
        return f"the profile's rate x {config.data_workers} loader process(es) per worker"
    return "unlimited"


def losses_table(predictions: Sequence[Prediction], most: int = 4) -> str:
    """One line per world size: its largest `most` losses in ms, largest first."""
    lines = []
    for p in predictions:
        top = sorted(p.losses_ms.items(), key=lambda kv: -kv[1])[:most]
        text = "; ".join(f"{label} {ms:.2f}" for label, ms in top) or "none"
        lines.append(f"- N = {p.world_size}: {text}")
    return "\n".join(lines)


__all__ = [
    "JSON_KEYS",
    "format_table",
    "losses_table",
    "plot",
    "profile_summary",
    "result_doc",
    "results_from_doc",
    "write_report",
]


def _setup(results: dict) -> tuple[set[str], set[str]]:
    """The model predicted and its batch, for `dpscale report A B`."""
    profile, config = results["profile"], results["config"]
    batch = config.get("per_worker_batch") or profile.get("per_worker_batch")
    return {str(profile.get("model"))}, {f"{batch}/worker"}


# rows matched on world_size -> step_ms, samples_per_s, efficiency
FIGURES = Figures(
    ("world_size",), (), ("step_ms", "samples_per_s", "efficiency"), lambda r: r["predictions"], _setup
)
