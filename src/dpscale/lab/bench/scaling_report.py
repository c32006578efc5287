"""Rendering of scaling bench results: the terminal table, the two plots and the report directory.

Everything here works from a `ScalingResult` alone, so `dpscale report` re-renders old runs.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import TYPE_CHECKING

from dpscale.errors import import_extra
from dpscale.lab.bench import scaling
from dpscale.lab.bench.bench import Bench, Figures, points, values
from dpscale.lab.bench.report import Image, ReportDir, Section, Table, new_figure, text_table
from dpscale.lab.bench.scaling import ScalingConfig, ScalingPoint, ScalingResult
from dpscale.lab.bench.scaling_rank import STEPS_PER_ROUND
from dpscale.lab.bench.trust import timing_warnings

if TYPE_CHECKING:  # matplotlib: the lab extra, imported when a plot is drawn
    from matplotlib.figure import Figure

_ENGINE_COLORS = {"dpscale": "C0", "torch": "C1", "local": "C2", "dpscale-gloo": "C3"}


_COLUMNS = {  # point field: (table header, format); None = "-"
    "engine": ("engine", ""),
    "transport": ("transport", ""),
    "world_size": ("N", "d"),
    "hosts": ("hosts", "d"),
    "per_worker_batch": ("batch/worker", "d"),
    "global_batch": ("global batch", "d"),
    "step_ms": ("step ms", ".2f"),
    "step_ms_p10": ("p10 ms", ".2f"),
    "step_ms_p90": ("p90 ms", ".2f"),
    "samples_per_s": ("samples/s", ".0f"),
    "efficiency": ("efficiency", ".1%"),
    "ceiling_fraction": ("of ceiling", ".1%"),
    "overhead_ms": ("overhead ms", ".2f"),
    "comm_ms": ("comm ms", ".2f"),
    "exposed_comm_ms": ("exposed ms", ".2f"),
    "overlap_pct": ("overlap %", ".0f"),
    "straggler_ms": ("straggler ms", ".2f"),
}


def _describe(config: ScalingConfig) -> str:
    batch = (
        f"{config.per_worker_batch} samples/worker"
        if config.mode == "weak"
        else f"global batch {config.global_batch}"
    )
    return f"{config.mode} scaling, {config.model}, {batch}"


def format_table(result: ScalingResult) -> str:
    """The points as a fixed-width terminal table (the report's table, same cells)."""
    formats = {k: f for k, (_, f) in _COLUMNS.items() if f}
    headers = {k: h for k, (h, _) in _COLUMNS.items()}
    table = text_table([asdict(p) for p in result.points], list(_COLUMNS), formats, headers)
    return f"{_describe(result.config)}\n{table}"


def warnings(result: ScalingResult) -> list[str]:
    """The trust checks (bench/trust.py) on the points: print them and put them in the report."""
    return timing_warnings({**asdict(p), "spread": p.spread} for p in result.points)


def _engine_series(points: list[ScalingPoint]) -> dict[str, list[ScalingPoint]]:
    series: dict[str, list[ScalingPoint]] = {}
    for p in sorted(points, key=lambda p: p.world_size):
        series.setdefault(p.engine, []).append(p)
    return series


def _workers_axis(fig: Figure, result: ScalingResult, ylabel: str, title: str):
    ax = fig.add_subplot()
    sizes = sorted({p.world_size for p in result.points})
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.set_xlim(min(sizes) - 0.3, max(sizes) + 0.3)
    threads = result.config.threads_per_worker
    each = "1 intra-op thread" if threads == 1 else f"{threads} intra-op threads"
    ax.set(xlabel=f"workers N (processes, {each} each)", ylabel=ylabel)
    ax.set_title(f"{title}\n{_describe(result.config)}")
    ax.grid(True, alpha=0.35)
    return ax


def _label(engine: str, pts: list[ScalingPoint]) -> str:
    # The transport that carries traffic between workers: at N = 1 there is none (dpscale then
    # runs on gloo alone), so "dpscale (gloo, shm)" would only confuse.
    between = [p for p in pts if p.world_size > 1] or pts
    transports = list(dict.fromkeys(p.transport for p in between if p.transport != "none"))
    return f"{engine} ({', '.join(transports)})" if transports else engine


def _spread_bars(pts: list[ScalingPoint], value: list[float]) -> list[list[float]] | None:
    """Error bars of `value` (proportional to throughput) from the p10 and p90 step times:
    [below, above] for matplotlib's yerr, or None when the report kept no p10."""
    p10s = [p.step_ms_p10 for p in pts if p.step_ms_p10 is not None]
    if len(p10s) < len(pts):
        return None
    below = [v - v * p.step_ms / p.step_ms_p90 for p, v in zip(pts, value, strict=True)]
    above = [v * p.step_ms / p10 - v for p, p10, v in zip(pts, p10s, value, strict=True)]
    return [below, above]


def _dodge(result: ScalingResult, engine: str) -> float:
    """A small x shift per engine, so error bars of engines at one N stand side by side."""
    engines = list(dict.fromkeys(p.engine for p in result.points))
    return 0.04 * (engines.index(engine) - (len(engines) - 1) / 2)


def _separate(ys: list[float], min_gap: float) -> list[float]:
    """Label heights near `ys` at least `min_gap` apart, in the same order (labels never swap)."""
    order = sorted(range(len(ys)), key=ys.__getitem__)
    out = list(ys)
    for prev, i in zip(order, order[1:], strict=False):
        out[i] = max(out[i], out[prev] + min_gap)
    return out


def _note_spread(ax, result: ScalingResult) -> None:
    if all(p.step_ms_p10 is not None for p in result.points):
        ax.text(
            0.99, 0.01, "bars: p10-p90 over steps", transform=ax.transAxes, ha="right", va="bottom",
            fontsize="x-small", color="dimgray",
        )  # fmt: skip


def plot_throughput(result: ScalingResult) -> Figure:
    """Samples/s vs workers per engine, each with its ideal line N x (its own 1-worker throughput)."""
    fig = new_figure()
    ax = _workers_axis(fig, result, "throughput (samples/s, global batch)", "Throughput vs workers")
    for e, pts in _engine_series(result.points).items():
        color, ns = _ENGINE_COLORS.get(e), [p.world_size for p in pts]
        ys = [p.samples_per_s for p in pts]
        dodged = [n + _dodge(result, e) for n in ns]
        ax.errorbar(
            dodged, ys, yerr=_spread_bars(pts, ys), marker="o", lw=2, capsize=4, color=color,
            label=_label(e, pts),
        )  # fmt: skip
        if pts[0].world_size == 1 and len(pts) > 1:
            ax.plot(ns, [n * pts[0].samples_per_s for n in ns], ls="--", lw=1.2, color=color, alpha=0.8)
    # one legend entry for all the dashed lines; each has its engine's colour
    ax.plot([], [], ls="--", color="gray", label="ideal: N x same engine at N=1")
    _note_spread(ax, result)
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize="small")
    return fig


def plot_efficiency(result: ScalingResult) -> Figure:
    """Scaling efficiency (% of linear) vs workers per engine; 100% is perfect scaling."""
    fig = new_figure()
    ax = _workers_axis(fig, result, "scaling efficiency (% of linear)", "Scaling efficiency vs workers")
    ax.axhline(100, color="gray", ls="--", lw=1, label="ideal (100%)")
    top = 110.0
    labels: dict[int, list[tuple[float, str, str | None]]] = {}  # N -> (y, text, colour) per engine
    for e, pts in _engine_series(result.points).items():
        pts = [p for p in pts if p.efficiency is not None]
        if not pts:
            continue
        ys = [100 * eff for eff in (p.efficiency for p in pts) if eff is not None]  # all: filtered above
        bars = _spread_bars(pts, ys)
        highs = [y + above for y, above in zip(ys, bars[1], strict=True)] if bars else ys
        top = max(top, *(y * 1.1 for y in ys), *(h * 1.05 for h in highs))
        color = _ENGINE_COLORS.get(e)
        ax.errorbar(
            [p.world_size + _dodge(result, e) for p in pts],
            ys,
            yerr=bars,
            marker="o",
            lw=2,
            capsize=4,
            color=color,
            label=_label(e, pts),
        )
        for p, y in zip(pts, ys, strict=True):
            if p.world_size > 1:  # N=1 is 100% by definition; labels there would only overlap
                labels.setdefault(p.world_size, []).append((y, f"{y:.0f}%", color))
    # engines close together at one N would print their labels on top of each other: stack them
    offset_copy = import_extra("matplotlib.transforms", "drawing a report's plots").offset_copy
    beside = offset_copy(ax.transData, fig=fig, x=8, units="points")  # right of the points
    right = max(_dodge(result, p.engine) for p in result.points)  # ... and of their error bars
    for n, entries in labels.items():
        heights = _separate([y for y, _, _ in entries], min_gap=top * 0.055)
        for (_, text, color), h in zip(entries, heights, strict=True):
            ax.text(n + right, h, text, transform=beside, va="center", color=color)
    if not any(p.efficiency is not None for p in result.points):
        ax.text(
            0.5, 0.5, "no world size 1 measured: efficiency undefined", transform=ax.transAxes, ha="center"
        )
    _note_spread(ax, result)
    ax.set_ylim(0, top)
    ax.legend(loc="lower left", fontsize="small")
    return fig


def write_report(result: ScalingResult, report: ReportDir) -> None:
    """Fill `report` with report.json, scaling.csv, the two plots and report.md."""
    doc = result.to_dict()
    report.write_json(doc, config=doc["config"])
    report.write_csv("scaling", doc["points"])
    report.save_figure(plot_throughput(result), "scaling_throughput")
    report.save_figure(plot_efficiency(result), "scaling_efficiency")
    c = result.config
    formats = {k: f for k, (_, f) in _COLUMNS.items() if f}
    headers = {k: h for k, (h, _) in _COLUMNS.items()}
    method = (
        f"{_describe(c)}. Every engine is built from the same seed in the same ranks; engines alternate "
        f"in rounds of up to {STEPS_PER_ROUND} steps, after {c.warmup} warm-up steps, for {c.steps} timed "
        f"steps each. A step (zero_grad, forward, loss, backward, SGD step) counts at its slowest rank; "
        f"step ms and p90 are over steps. Intra-op threads per worker: {c.threads_per_worker}."
    )
    if c.nnodes is not None:
        method += (
            f" Across {c.nnodes} hosts: each N > 1 ran as one job of {c.nnodes} hosts x N/{c.nnodes} workers "
            "(every rank's times gathered inside the job); N = 1, the baseline of efficiency, ran on one "
            "host, the one serving the rendezvous store (the other hosts report no efficiency)."
        )
    definitions = (
        "efficiency = samples/s(N) / (N x samples/s(1)) for the same engine; of ceiling = samples/s / "
        "local engine's samples/s at the same N; overhead = step ms - local step ms; comm and exposed = "
        "median over steps of the engine's own per-step figures on rank 0 (dpscale's reducer stats; torch "
        "DDP's _get_ddp_logging_data(): backward comm time, less its overlap with backward compute; "
        "overhead counts everything the engine adds); overlap = 1 - exposed/comm; straggler = median of "
        "(slowest - fastest rank) per step. '-' = not applicable or not measured."
    )
    trust = warnings(result)
    report.write_markdown(
        "Scaling bench",
        [
            Section("Results", [method, definitions, Table(doc["points"], list(_COLUMNS), formats, headers)]),
            Section(
                "Plots",
                [
                    Image("scaling_throughput.png", "throughput vs workers"),
                    Image("scaling_efficiency.png", "scaling efficiency vs workers"),
                ],
            ),
        ],
        warnings=trust,
    )


def _setup(results: dict | list) -> tuple[set[str], set[str]]:
    """The models measured and the batches used, for `dpscale report A B`."""
    pts = points(results)
    batch = values(
        *(
            f"global {p.get('global_batch')}"
            if p.get("mode") == "strong"
            else f"{p.get('per_worker_batch')}/worker"
            for p in pts
        )
    )
    return values(*(p.get("model") for p in pts)), batch


BENCH = Bench(
    command="scaling",
    argv=("bench", "scaling"),
    help="throughput and scaling efficiency: dpscale vs torch DDP vs no synchronization",
    Config=ScalingConfig,
    run=lambda config: scaling.run(config),
    from_dict=ScalingResult.from_dict,
    write_report=write_report,
    # rows matched on engine, world_size (+ transport, model, mode, per_worker_batch while those
    # are needed to tell a report's points apart) -> samples_per_s, efficiency
    compare=Figures(
        ("engine", "world_size"),
        ("transport", "model", "mode", "per_worker_batch"),
        ("samples_per_s", "efficiency"),
        points,
        _setup,
    ),
    text=lambda result: [format_table(result)],
    json_line=lambda result: json.dumps([asdict(p) for p in result.points], allow_nan=False),
    warnings=warnings,
)
