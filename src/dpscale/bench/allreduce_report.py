"""Rendering of all-reduce bench results: the table, the fit, the plots and the report directory.

Everything here works from an `AllReduceResult` alone, so `dpscale report` re-renders old runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

from matplotlib.figure import Figure

from .allreduce import (
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
from .args import format_size
from .report import Image, ReportDir, Section, Table, new_figure, size_axis

_COLUMNS = ("transport", "world_size", "size", "bytes", "time_us", "algbw_GBps", "busbw_GBps")


def format_table(result: AllReduceResult) -> str:
    """The points as a fixed-width terminal table, one line per point."""
    lines = ["{:<10}{:>6}{:>8}{:>12}{:>12}{:>12}{:>12}".format(*_COLUMNS[:1], "world", *_COLUMNS[2:])]
    for p in result.points:
        lines.append(
            f"{p.transport:<10}{p.world_size:>6}{format_size(p.bytes):>8}{p.bytes:>12}"
            f"{p.time_us:>12.1f}{p.algbw_GBps:>12.4g}{p.busbw_GBps:>12.4g}"
        )
    return "\n".join(lines)


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


def _plot(points: Sequence[AllReducePoint], value: str, *, multi_rank_only: bool) -> Figure:
    fig = new_figure()
    ax = fig.add_subplot()
    for (transport, n), group in _series(points).items():
        if n > 1 or not multi_rank_only:
            xs, ys = [p.bytes for p in group], [getattr(p, value) for p in group]
            ax.plot(xs, ys, marker="o", label=f"{transport}, n={n}")
    if ax.lines:
        ax.legend(title="transport, world size")
    else:
        ax.text(0.5, 0.5, "no world size > 1 measured", transform=ax.transAxes, ha="center")
    size_axis(ax, [p.bytes for p in points])
    return fig


def plot_busbw(points: Sequence[AllReducePoint]) -> Figure:
    """Bus bandwidth vs message size, one line per (transport, world size > 1)."""
    fig = _plot(points, "busbw_GBps", multi_rank_only=True)  # busbw is 0 by definition at n = 1
    ax = fig.axes[0]
    ax.set(ylabel="bus bandwidth (GB/s)", title="All-reduce bus bandwidth, busbw = algbw * 2(n-1)/n")
    ax.set_ylim(bottom=0)
    return fig


def plot_latency(points: Sequence[AllReducePoint]) -> Figure:
    """Median time per all-reduce vs message size (log-log), one line per (transport, world size)."""
    fig = _plot(points, "time_us", multi_rank_only=False)
    fig.axes[0].set(yscale="log", ylabel="time per all-reduce (µs, slowest rank)", title="All-reduce latency")
    return fig


def write_report(result: AllReduceResult, report: ReportDir) -> None:
    """Fill `report` with report.json, allreduce.csv, the two plots and report.md."""
    doc = result.to_dict()
    report.write_json(doc, config=doc["config"])
    report.write_csv("allreduce", doc["points"])
    report.save_figure(plot_busbw(result.points), "allreduce_busbw")
    report.save_figure(plot_latency(result.points), "allreduce_latency")
    rows = [{**p, "size": format_size(p["bytes"])} for p in doc["points"]]
    fmt = {"time_us": ".1f", "algbw_GBps": ".4g", "busbw_GBps": ".4g"}
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
                    "World size 1 moves no data between ranks and is left out of the bandwidth plot."
                    if any(p.world_size == 1 for p in result.points)
                    else "",
                    Image("allreduce_latency.png", "time per all-reduce vs message size"),
                ],
            ),
        ],
    )
