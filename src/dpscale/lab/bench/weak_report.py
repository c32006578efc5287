"""Rendering of weak-scaling convergence results: table, texts, plots and the report directory.

Everything here works from a `WeakResult` alone, so `dpscale report` re-renders old runs.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

from dpscale.lab.bench import weak
from dpscale.lab.bench.bench import Bench, Figures, values
from dpscale.lab.bench.report import Image, ReportDir, Section, Table, new_figure
from dpscale.lab.bench.trust import timing_warnings
from dpscale.lab.bench.weak import WeakResult

if TYPE_CHECKING:  # matplotlib: the lab extra, imported when a plot is drawn
    from matplotlib.figure import Figure

_COLUMNS = (
    "world_size global_batch lr steps_to_target samples_to_target step_ms spread time_to_target_s "
    "statistical_efficiency throughput_speedup time_to_target_speedup gns_at_target"
).split()
_HEADERS = {
    "world_size": "N",
    "global_batch": "batch",
    "steps_to_target": "steps",
    "samples_to_target": "samples",
    "spread": "p10-p90",
    "time_to_target_s": "time_to_target_s",
    "statistical_efficiency": "stat_eff",
    "throughput_speedup": "throughput_x",
    "time_to_target_speedup": "ttt_x",
    "gns_at_target": "noise_scale",
}
_FORMATS: dict[str, str] = dict(
    lr=".4g",
    step_ms=".2f",
    spread=".0%",
    time_to_target_s=".2f",
    statistical_efficiency=".2f",
    throughput_speedup=".2f",
    time_to_target_speedup=".2f",
    gns_at_target=".0f",
)
NOT_REACHED = "not reached"


def _rows(result: WeakResult) -> list[dict]:
    rows = []
    for r in result.runs:
        row = r.to_dict() | result.ratios(r) | {"spread": r.spread}
        if not r.reached:  # say so in the cells a reader looks at, rather than leave them blank
            row |= {"steps_to_target": NOT_REACHED, "samples_to_target": NOT_REACHED}
        rows.append(row)
    return rows


def _cell(value: object, fmt: str) -> str:
    if value is None:
        return "-"
    return value if isinstance(value, str) else format(value, fmt)


def format_table(result: WeakResult) -> str:
    """One line per N, fixed width, for the terminal."""
    cols = _COLUMNS
    width = {c: max(len(_HEADERS.get(c, c)), 11) + 1 for c in cols}
    lines = ["".join(f"{_HEADERS.get(c, c):>{width[c]}}" for c in cols)]
    for row in _rows(result):
        lines.append("".join(f"{_cell(row[c], _FORMATS.get(c, '')):>{width[c]}}" for c in cols))
    return "\n".join(lines)


def _train_loss_note(result: WeakResult) -> str:
    if result.target_on == "train":
        return f"; {result.config.workload} has no eval set: its training loss averaged since the last check"
    return ""


def method_text(result: WeakResult) -> str:
    c = result.config
    rule = {
        "none": "the N=1 rate at every N",
        "linear": "N x the N=1 rate (Goyal et al. 2017)",
        "sqrt": "sqrt(N) x the N=1 rate (Krizhevsky 2014)",
        "adascale": "the N=1 rate times AdaScale's gain from the measured noise scale (Johnson et al. 2020)",
    }[c.lr_rule]
    warm = f", linear warm-up over {c.warmup_steps} steps" if c.warmup_steps else ""
    return (
        f"Workload {c.workload}, engine {c.engine}, {c.batch_per_worker} samples per worker per step, "
        f"so the global batch is N x {c.batch_per_worker}; seed {c.seed}. "
        f"Learning rate: {rule}, from {c.lr:g}{warm}. "
        f"Target: {result.target_text}, checked every {c.eval_every_samples} samples (the same sample "
        f"counts at every N{_train_loss_note(result)}); "
        f"budget {c.max_samples} samples per N. Time to target = steps x the median training step "
        "(evaluations excluded) of the same run; p10-p90 = (p90 - p10) / median of those steps. "
        "Statistical efficiency = samples to target at N=1 / "
        "at N (above 1: N needed fewer samples, from its learning rate or the noise of one run); "
        "time-to-target speed-up = throughput speed-up x statistical efficiency. The runs were "
        "sequential on this host: step times carry its load at the time."
    )


def warnings(result: WeakResult) -> list[str]:
    """The trust checks (bench/trust.py) on each N's step-time spread, plus two figures no weak run
    can honestly produce: a step time that is not positive, and N workers more than N times as fast
    as one (every N gets the same threads per worker, so only a slowed N=1 explains it)."""
    c = result.config
    where = f"{c.workload} {c.engine} N="
    rows = [
        {"model": c.workload, "engine": c.engine, "world_size": r.world_size, "spread": r.spread}
        for r in result.runs
    ]
    out = timing_warnings(rows, more="steps (a stricter target)")
    broken = [
        f"{where}{r.world_size} {r.step_ms:g} ms"
        for r in result.runs
        if not (math.isfinite(r.step_ms) and r.step_ms > 0)
    ]
    if broken:  # every ratio divides by a step time: say only this
        return [
            *out,
            f"step times that are not positive ({', '.join(broken)}): the per-step timings are broken, "
            "so no time or speed-up here means anything; rerun",
        ]
    faster = [
        f"{where}{r.world_size} x{q:.2f}"
        for r in result.runs
        if (q := result.ratios(r)["throughput_speedup"]) > r.world_size
    ]
    if faster:
        out.append(
            f"throughput speed-up above N ({', '.join(faster)}): N workers with the same threads each "
            "cannot do more than N times the work of one, so N=1 was slowed by the host's load and "
            "every speed-up here is overstated; rerun on a quieter host"
        )
    return out


def findings_text(result: WeakResult) -> str:
    ref = result.reference
    if not ref.reached:
        return f"N=1 did not reach the target within the budget: no ratio can be formed ({NOT_REACHED})."
    lines = []
    for r in result.runs:
        if r is ref:
            continue
        q = result.ratios(r)
        if not r.reached:
            lines.append(f"N={r.world_size}: {NOT_REACHED} within {result.config.max_samples} samples.")
            continue
        lines.append(
            f"N={r.world_size}: throughput x{q['throughput_speedup']:.2f}, statistical efficiency "
            f"{q['statistical_efficiency']:.2f}, so time to target x{q['time_to_target_speedup']:.2f}."
        )
    return " ".join(lines) or "Only N=1 ran: there is nothing to compare."


def _time_axis(run) -> list[float]:
    return [c["step"] * run.step_ms / 1e3 for c in run.checks]


def plot_curves(result: WeakResult) -> Figure:
    """The target's quantity vs samples (left) and vs training time (right), one line per N."""
    fig = new_figure(10.0, 4.5)
    left, right = fig.subplots(1, 2, sharey=True)
    name, value = result.config.target
    for i, r in enumerate(result.runs):
        style, label = ["-", "--", ":", "-."][i % 4], f"N={r.world_size} (batch {r.global_batch})"
        ys = [c["value"] for c in r.checks]
        (line,) = left.plot([c["samples"] for c in r.checks], ys, style, marker=".", label=label)
        right.plot(_time_axis(r), ys, style, marker=".", color=line.get_color(), label=label)
    for ax, xlabel in ((left, "samples seen"), (right, "training time (s): steps x median step")):
        ax.axhline(value, color="tab:red", lw=1, ls="--", label=f"target {value:g}")
        ax.set(xlabel=xlabel)
        ax.grid(True, alpha=0.35)
    left.set(ylabel=f"{result.target_on} {name}", title=f"{result.config.workload}: {result.target_text}")
    right.set(title=f"lr rule {result.config.lr_rule}")
    left.legend(fontsize="small")
    return fig


def plot_speedup(result: WeakResult) -> Figure:
    """Throughput speed-up and time-to-target speed-up vs N, with the ideal line."""
    fig = new_figure(6.5, 4.5)
    ax = fig.subplots()
    ns = [r.world_size for r in result.runs]
    ratios = [result.ratios(r) for r in result.runs]
    ax.plot(ns, ns, color="0.6", ls=":", label="ideal (N)")
    ax.plot(ns, [q["throughput_speedup"] for q in ratios], "o-", label="throughput speed-up")
    ttt = [q["time_to_target_speedup"] for q in ratios]
    ax.plot(ns, [math.nan if v is None else v for v in ttt], "s--", label="time-to-target speed-up")
    for n, v in zip(ns, ttt, strict=True):
        if v is None:
            ax.annotate(NOT_REACHED, (n, 1.0), ha="center", color="tab:red")
    ax.set(xlabel="workers N (global batch grows with N)", ylabel="speed-up vs N=1", xticks=ns)
    ax.set_title(f"{result.config.workload}, lr rule {result.config.lr_rule}")
    ax.grid(True, alpha=0.35)
    ax.legend(fontsize="small")
    return fig


def check_rows(result: WeakResult) -> list[dict]:
    """weak.csv: one row per (N, evaluation)."""
    return [
        {"world_size": r.world_size, "global_batch": r.global_batch, **c, "time_s": t}
        for r in result.runs
        for c, t in zip(r.checks, _time_axis(r), strict=True)
    ]


def write_report(result: WeakResult, report: ReportDir) -> None:
    """report.json, weak.csv, weak_curves.png, weak_speedup.png and report.md."""
    doc = result.to_dict()
    report.write_json(doc, config=doc["config"])
    report.write_csv("weak", check_rows(result))
    report.save_figure(plot_curves(result), "weak_curves")
    report.save_figure(plot_speedup(result), "weak_speedup")
    table = Table(_rows(result), _COLUMNS, _FORMATS, _HEADERS)
    report.write_markdown(
        "Convergence bench, weak scaling (global batch grows with N)",
        [
            Section("Method", [method_text(result)]),
            Section("Results", [table, findings_text(result)]),
            Section(
                "Curves",
                [
                    Image("weak_curves.png", "target quantity vs samples and vs time per N"),
                    Image("weak_speedup.png", "throughput and time-to-target speed-up vs N"),
                    "CSV: weak.csv (each evaluation per N: step, samples, value, noise scale, time).",
                ],
            ),
        ],
        warnings=warnings(result),
    )


BENCH = Bench(  # a mode of `bench convergence`, with a report of its own
    command="convergence-weak",
    argv=("bench", "convergence", "--mode", "weak"),
    help="time to a target as the global batch grows with N",
    Config=weak.WeakConfig,
    run=lambda config: weak.run(config),
    from_dict=WeakResult.from_dict,
    write_report=write_report,
    # rows matched on world_size -> time_to_target_s, statistical_efficiency, samples_per_s
    compare=Figures(
        ("world_size",),
        (),
        ("time_to_target_s", "statistical_efficiency", "samples_per_s"),
        lambda r: r["runs"],
        lambda r: (
            values(r["config"].get("workload")),
            values(f"{r['config'].get('batch_per_worker')}/worker"),
        ),
    ),
    text=lambda result: [format_table(result), findings_text(result)],
    json_line=lambda result: json.dumps(result.summary()),
    warnings=warnings,
    exit_code=lambda result: 0 if result.reference.reached else 1,  # the ratios need N=1's time
)
