"""Rendering of convergence bench results: table, texts, the loss-curve plot and the report directory.

Everything here works from a `ConvergenceResult` alone, so `dpscale report` re-renders old runs.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

from dpscale.lab.bench import convergence
from dpscale.lab.bench.bench import Bench, Figures, values
from dpscale.lab.bench.convergence import (
    ConvergenceResult,
    _nan,
    compared_from,
    gaps,
    smooth,
    smoothing_window,
    verdict,
)
from dpscale.lab.bench.report import CellFormat, Image, ReportDir, Section, Table, new_figure, text_table

if TYPE_CHECKING:  # matplotlib: the lab extra, imported when a plot is drawn
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def _rows(result: ConvergenceResult) -> list[dict]:
    ref = result.reference
    return [
        {
            **r.to_dict(),
            "verdict": verdict(r, ref.world_size),
            "same_weights": "yes" if r.param_sha256 == ref.param_sha256 else "no",
        }
        for r in result.runs
    ]


_COLUMNS = (
    "world_size accumulation_steps micro_batch steps samples final_loss test_accuracy max_gap max_rel_gap "
    "verdict same_weights wall_s"
).split()


def _pct(fraction: float) -> str:
    """3 significant digits: a rounding-level gap (3.8e-05%) must not print as 0.00%."""
    return f"{100 * fraction:.3g}%"


_FORMATS: dict[str, CellFormat] = dict(
    final_loss=".4f", test_accuracy=".2%", max_gap=".3g", max_rel_gap=_pct, wall_s=".1f"
)
# the terminal table's columns and headers (the report's table has them all)
_TERMINAL = ["world_size", "accumulation_steps", "micro_batch", "steps", "final_loss", "test_accuracy",
             "max_gap", "max_rel_gap", "wall_s", "verdict"]  # fmt: skip
_TERMINAL_HEADERS = {"world_size": "world", "accumulation_steps": "k", "micro_batch": "micro",
                     "test_accuracy": "test_acc", "max_rel_gap": "max_rel"}  # fmt: skip


def format_table(result: ConvergenceResult) -> str:
    """The runs as a fixed-width terminal table, one line per world size."""
    return text_table(_rows(result), _TERMINAL, _FORMATS, _TERMINAL_HEADERS)


def method_text(result: ConvergenceResult) -> str:
    c, steps = result.config, result.config.steps
    assert c.global_batch is not None  # set by ConvergenceConfig.__post_init__
    return (
        f"Workload {c.workload}, global batch {c.global_batch}, {steps} steps ({steps * c.global_batch} "
        f"samples), seed {c.seed}; world size W accumulates max(W)/W micro-batches of "
        f"{c.global_batch // max(c.world_sizes)} samples, so every run sees the same samples per step. "
        f"Gap: each loss curve is smoothed with a centred {smoothing_window(steps)}-step moving average "
        f"and compared with world size {result.reference.world_size}'s over the second half of "
        f"training (steps {compared_from(steps) + 1}-{steps}); max_rel_gap is the largest "
        f"|difference| / reference loss there, and a run departs when it exceeds the tolerance of "
        f"{_pct(c.tolerance)}."
        + (
            f" Every world size but the reference trains with {c.compression} gradient compression; "
            f"the reference (world size {result.reference.world_size}) is uncompressed."
            if c.compression != "none"
            else ""
        )
    )


def largest_gap_text(result: ConvergenceResult) -> str:
    others = [r for r in result.runs if r is not result.reference]
    if not others:
        return "Only one world size ran: there is nothing to compare."
    if any(r.max_rel_gap is None for r in others):
        return "At least one run has a non-finite loss in the compared steps: it departs."
    gaps_by_run = [(r.max_rel_gap, r) for r in others if r.max_rel_gap is not None]  # all, checked above
    worst_gap, worst = max(gaps_by_run, key=lambda gap_run: gap_run[0])
    return (
        f"Largest gap: world size {worst.world_size} vs {result.reference.world_size}: "
        f"{worst.max_gap:.3g} absolute, {_pct(worst_gap)} relative "
        f"(tolerance {_pct(result.config.tolerance)})."
    )


def plot_curves(result: ConvergenceResult) -> Figure:
    """Loss vs samples seen per world size (top), relative gap to the reference (bottom)."""
    fig = new_figure(8.0, 6.0)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    ref, steps = result.reference, result.config.steps
    window, start = smoothing_window(steps), compared_from(steps)
    any_gap = False
    for i, r in enumerate(result.runs):
        # distinct dashes: equivalent runs lie on top of each other, and all of them must stay visible
        style, label = ["-", "--", ":", "-."][i % 4], f"W={r.world_size}, k={r.accumulation_steps}"
        (line,) = top.plot(r.samples_seen, smooth(r.losses, window), style, lw=2, label=label)
        top.plot(r.samples_seen, _nan(r.losses), lw=0.7, alpha=0.3, color=line.get_color())
        if r is not ref:
            # exact zeros (bitwise equal losses) have no place on a log axis: left out, not faked
            rel = [100 * rel if rel > 0 else math.nan for _, rel in gaps(ref.losses, r.losses, window)]
            any_gap |= any(math.isfinite(y) for y in rel)
            bottom.plot(r.samples_seen, rel, style, color=line.get_color(), label=label)
    labels: tuple[tuple[Axes, str | None], ...] = ((top, "compared"), (bottom, None))
    for ax, span_label in labels:
        ax.axvspan(ref.samples_seen[start], ref.samples_seen[-1], color="0.9", zorder=0, label=span_label)
        ax.grid(True, alpha=0.35)
    if all(v is not None and v > 0 for r in result.runs for v in r.losses):
        top.set_yscale("log")  # the late, small losses are where runs part; a log axis shows them
    c = result.config
    title = f"{c.workload}, global batch {c.global_batch}: loss per step (thin), {window}-step mean (thick)"
    top.set(ylabel="training loss (mean over the global batch)", title=title)
    top.legend(title="world size, accumulation")
    bottom.axhline(100 * c.tolerance, color="tab:red", lw=1, ls="--", label=f"tolerance {_pct(c.tolerance)}")
    # log: equivalent runs differ by rounding (1e-5 %), a broken one by whole percents; both must show
    bottom.set(yscale="log", xlabel="samples seen", ylabel=f"gap to W={ref.world_size} (% of its loss)")
    bottom.set_ylim(top=max(bottom.get_ylim()[1], 1000 * c.tolerance))  # a decade above the tolerance
    if not any_gap:
        why = "equal losses at every step" if len(result.runs) > 1 else "one world size: nothing to compare"
        bottom.text(0.5, 0.5, why, transform=bottom.transAxes, ha="center")
    bottom.legend(loc="upper left", fontsize="small")
    return fig


def curve_rows(result: ConvergenceResult) -> list[dict]:
    """convergence.csv: one row per (world size, step)."""
    window = smoothing_window(result.config.steps)
    return [
        {"world_size": r.world_size, "accumulation_steps": r.accumulation_steps, "step": i + 1,
         "samples_seen": seen, "loss": loss, "smoothed_loss": smoothed}
        for r in result.runs
        for i, (seen, loss, smoothed) in enumerate(
            zip(r.samples_seen, r.losses, smooth(r.losses, window), strict=True))
    ]  # fmt: skip


def write_report(result: ConvergenceResult, report: ReportDir) -> None:
    """Fill `report` with report.json, convergence.csv, convergence.png and report.md."""
    doc = result.to_dict()
    report.write_json(doc, config=doc["config"])
    report.write_csv("convergence", curve_rows(result))
    report.save_figure(plot_curves(result), "convergence")
    weights = (
        "same_weights: whether the final parameters hash (SHA-256) equal to the reference's; float sums "
        "in another order usually make them differ in the last bits, which is harmless."
    )
    table = Table(_rows(result), _COLUMNS, _FORMATS, {"accumulation_steps": "k", "micro_batch": "micro"})
    image = Image("convergence.png", "training loss vs samples seen per world size")
    report.write_markdown(
        "Convergence bench",
        [
            Section("Method", [method_text(result)]),
            Section("Results", [table, largest_gap_text(result), weights]),
            Section("Loss curves", [image, "CSV: convergence.csv (loss per step per world size)."]),
        ],
    )


def _text(result: ConvergenceResult) -> list[str]:
    lines = [format_table(result)]
    if result.config.compression != "none":
        ref = result.reference.world_size
        lines.append(
            f"compression: {result.config.compression} at every world size but {ref} (uncompressed reference)"
        )
    return [*lines, largest_gap_text(result)]


BENCH = Bench(
    command="convergence",
    argv=("bench", "convergence"),
    help="loss curves at several world sizes with the same global batch; "
    "--mode weak: time to a target as the batch grows with N",
    Config=convergence.ConvergenceConfig,
    run=lambda config: convergence.run(config),
    from_dict=ConvergenceResult.from_dict,
    write_report=write_report,
    # rows matched on world_size -> final_loss, test_accuracy
    compare=Figures(
        ("world_size",),
        (),
        ("final_loss", "test_accuracy"),
        lambda r: r["runs"],
        lambda r: (values(r["config"].get("workload")), values(f"global {r['config'].get('global_batch')}")),
    ),
    text=_text,
    json_line=lambda result: json.dumps(result.summary()),
    # exit 1 when a world size departs from the reference beyond the tolerance
    exit_code=lambda result: 0 if all(r.within_tolerance for r in result.runs) else 1,
)
