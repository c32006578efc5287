"""Rendering of all-reduce bench results: the table, the fit, the plots and the report directory.

Everything here works from an `AllReduceResult` alone, so `dpscale report` re-renders old runs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import fields
from typing import TYPE_CHECKING

from dpscale.lab.bench import allreduce, transports
from dpscale.lab.bench.allreduce import (
    BUSBW_CONVENTION,
    MAX_ITERS,
    MIN_ITERS,
    TARGET_POINT_S,
    WARMUP_ITERS,
    AllReducePoint,
    AllReduceResult,
    LatencyBandwidthFit,
    _series,
)
from dpscale.lab.bench.args import format_size
from dpscale.lab.bench.bench import Bench, Figures, points
from dpscale.lab.bench.report import Image, ReportDir, Section, Table, new_figure, size_axis, text_table
from dpscale.lab.bench.trust import timing_warnings

if TYPE_CHECKING:  # matplotlib: the lab extra, imported when a plot is drawn
    from matplotlib.figure import Figure

_COLUMNS = (
    "transport", "world_size", "size", "bytes", "time_us", "time_us_p10", "time_us_p90", "algbw_GBps",
    "busbw_GBps",
)  # fmt: skip


def format_table(result: AllReduceResult) -> str:
    """The points as a fixed-width terminal table, one line per point."""
    rows, fmt = _rows(result)
    return text_table(rows, _COLUMNS, fmt, {"world_size": "world"})


def _rows(result: AllReduceResult) -> tuple[list[dict], dict]:
    rows = [{**p.to_dict(), "size": format_size(p.bytes)} for p in result.points]
    fmt = {
        "time_us": ".1f",
        "time_us_p10": ".1f",
        "time_us_p90": ".1f",
        "algbw_GBps": ".4g",
        "busbw_GBps": ".4g",
    }
    return rows, fmt


def format_fits(result: AllReduceResult) -> str:
    if not result.fits:
        return "latency-bandwidth fit: none (needs world size > 1 and two or more sizes)"
    lines = ["latency-bandwidth fit t = alpha + bytes/beta (beta is the asymptotic algbw):"]
    for f in result.fits:
        beta = f"{f.beta_GBps:.3g} GB/s" if f.beta_GBps is not None else "n/a (time does not grow with size)"
        lines.append(
            f"  {f.transport} n={f.world_size}: alpha = {f.alpha_us:.1f} us, beta = {beta} "
            f"(rms relative error {f.rms_rel_error:.1%} over {f.points} sizes)"
        )
    return "\n".join(lines)


def warnings(result: AllReduceResult) -> list[str]:
    """The trust checks (bench/trust.py) on the points' spread over iterations; a one-rank
    "all-reduce" crosses no link, so its jitter is the host's alone and is left out."""
    rows = [
        {"label": f"{p.transport} n={p.world_size} {format_size(p.bytes)}", "spread": p.spread}
        for p in result.points
        if p.world_size > 1
    ]
    return timing_warnings(rows, more="--iters")


def _band(p: AllReducePoint, value: str) -> tuple[float, float]:
    """`value`'s range over the p10-p90 iterations: a time's p10 is a bandwidth's p90 (bytes / time)."""
    assert p.time_us_p10 is not None and p.time_us_p90 is not None  # _plot bands only points with both
    if value == "time_us":
        return p.time_us_p10, p.time_us_p90
    y = getattr(p, value)
    return y * p.time_us / p.time_us_p90, y * p.time_us / p.time_us_p10


def _plot(points: Sequence[AllReducePoint], value: str) -> Figure:
    """One line per (transport, world size > 1): at world size 1 nothing crosses a link, so
    neither its bandwidth (0 by definition) nor its time says anything about a transport. The
    band around a line is the p10-p90 range over iterations, where the report kept it."""
    fig = new_figure()
    ax = fig.add_subplot()
    banded = False
    for (transport, n), group in _series(points).items():
        if n == 1:
            continue
        xs, ys = [p.bytes for p in group], [getattr(p, value) for p in group]
        (line,) = ax.plot(xs, ys, marker="o", label=f"{transport}, n={n}")
        if all(p.time_us_p10 is not None and p.time_us_p90 is not None for p in group):
            lo, hi = zip(*(_band(p, value) for p in group), strict=True)
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.18, lw=0)
            banded = True
    if ax.lines:
        title = "transport, world size" + ("\n(bands: p10-p90 over iterations)" if banded else "")
        ax.legend(title=title, fontsize="small", title_fontsize="small")
    else:
        ax.text(0.5, 0.5, "no world size > 1 measured", transform=ax.transAxes, ha="center")
    size_axis(ax, [p.bytes for p in points])
    ax.set_yscale("log")  # small messages move bytes/s orders of magnitude below large ones
    return fig


def plot_busbw(points: Sequence[AllReducePoint]) -> Figure:
    """Bus bandwidth vs message size (log-log), one line per (transport, world size > 1)."""
    fig = _plot(points, "busbw_GBps")
    fig.axes[0].set(
        ylabel="bus bandwidth (GB/s, log scale)", title="All-reduce bus bandwidth, busbw = algbw * 2(n-1)/n"
    )
    return fig


def plot_latency(points: Sequence[AllReducePoint]) -> Figure:
    """Median time per all-reduce vs message size (log-log), one line per (transport, world size > 1)."""
    fig = _plot(points, "time_us")
    fig.axes[0].set(ylabel="time per all-reduce (µs, slowest rank)", title="All-reduce latency")
    return fig


def write_report(result: AllReduceResult, report: ReportDir) -> None:
    """Fill `report` with report.json, allreduce.csv, the two plots and report.md."""
    doc = result.to_dict()
    report.write_json(doc, config=doc["config"])
    report.write_csv("allreduce", doc["points"])
    report.save_figure(plot_busbw(result.points), "allreduce_busbw")
    report.save_figure(plot_latency(result.points), "allreduce_latency")
    rows, fmt = _rows(result)
    fit_fmt = {"alpha_us": ".1f", "beta_GBps": ".3g", "rms_rel_error": ".1%"}
    iters = result.config.iters or f"adaptive ({MIN_ITERS}-{MAX_ITERS}, ~{TARGET_POINT_S} s per point)"
    method = (
        f"In-place float32 sum; {WARMUP_ITERS} warm-up and {iters} timed iterations per point. An "
        "iteration's time is the slowest rank's; a point's is the median over iterations. GB/s = 1e9 B/s."
    )
    fit_text = "t = alpha + bytes/beta, least squares on relative error; beta is the asymptotic algbw."
    report.write_markdown(
        "All-reduce bench",
        [
            Section("Results", [method, BUSBW_CONVENTION + ".", Table(rows, _COLUMNS, fmt)]),
            Section(
                "Latency-bandwidth fit",
                [fit_text, Table(doc["fits"], [f.name for f in fields(LatencyBandwidthFit)], fit_fmt)],
            ),
            Section(
                "Plots",
                [
                    Image("allreduce_busbw.png", "bus bandwidth vs message size"),
                    "World size 1 moves no data between ranks and is left out of both plots (its "
                    "times are in the table)."
                    if any(p.world_size == 1 for p in result.points)
                    else "",
                    Image("allreduce_latency.png", "time per all-reduce vs message size"),
                ],
            ),
        ],
        warnings=warnings(result),
    )


BENCH = Bench(
    command="allreduce",
    argv=("bench", "allreduce"),
    help="all-reduce time and bandwidth vs message size, world size and transport",
    Config=allreduce.AllReduceConfig,
    run=lambda config: allreduce.run(config),
    from_dict=AllReduceResult.from_dict,
    write_report=write_report,
    # rows matched on transport, world_size, bytes -> time_us, busbw_GBps
    compare=Figures(("transport", "world_size", "bytes"), (), ("time_us", "busbw_GBps"), points),
    text=lambda result: [format_table(result), BUSBW_CONVENTION, format_fits(result)],
    json_line=lambda result: json.dumps([p.to_dict() for p in result.points]),
    warnings=warnings,
    defaults=lambda: {"transports": transports.available_transports()},  # not just gloo, as the API's
)
