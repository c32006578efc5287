"""Rendering of `dpscale scale` results: the terminal table, one plot and the report directory.

Everything works from a `ScaleResult` alone, so `dpscale report DIR` re-renders an old run.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict
from pathlib import Path

from dpscale.lab.bench import script_scaling
from dpscale.lab.bench.bench import Bench, Figures, points, values
from dpscale.lab.bench.report import Image, ReportDir, Section, Table, new_figure, text_table
from dpscale.lab.bench.script_scaling import ScaleConfig, ScaleResult
from dpscale.lab.bench.trust import timing_warnings
from dpscale.paths import write_no_follow

_COLUMNS = {  # point field: (header, format)
    "engine": ("engine", ""),
    "transport": ("transport", ""),
    "world_size": ("N", "d"),
    "hosts": ("hosts", "d"),
    "steps": ("steps", "d"),
    "samples_per_step": ("samples/step", ".0f"),
    "step_ms": ("step ms", ".2f"),
    "step_ms_p10": ("p10 ms", ".2f"),
    "step_ms_p90": ("p90 ms", ".2f"),
    "samples_per_s": ("samples/s", ".0f"),
    "efficiency": ("efficiency", ".1%"),
    "exposed_comm_ms": ("exposed ms", ".2f"),
}


def _command(result: ScaleResult) -> str:
    return shlex.join([result.config.script, *result.config.args])


def format_table(result: ScaleResult) -> str:
    """The points as a fixed-width terminal table (the report's table, same cells)."""
    formats = {k: f for k, (_, f) in _COLUMNS.items() if f}
    headers = {k: h for k, (h, _) in _COLUMNS.items()}
    table = text_table([asdict(p) for p in result.points], list(_COLUMNS), formats, headers)
    return f"scaling of {_command(result)}\n{table}"


def plot(result: ScaleResult):
    """Throughput (with each engine's ideal N x its 1-worker figure) and efficiency vs workers."""
    fig = new_figure(11.0, 4.5)
    thr, eff = fig.subplots(1, 2)
    sizes = sorted({p.world_size for p in result.points})
    for i, engine in enumerate(result.config.engines):
        pts = sorted((p for p in result.points if p.engine == engine), key=lambda p: p.world_size)
        ns = [p.world_size for p in pts]
        color = f"C{i}"
        thr.plot(ns, [p.samples_per_s for p in pts], marker="o", lw=2, color=color, label=engine)
        if pts and pts[0].world_size == 1:
            thr.plot(ns, [n * pts[0].samples_per_s for n in ns], ls="--", lw=1, color=color, alpha=0.7)
        with_eff = [p for p in pts if p.efficiency is not None]
        eff.plot(
            [p.world_size for p in with_eff],
            [100 * eff for eff in (p.efficiency for p in with_eff) if eff is not None],  # all of them
            marker="o",
            lw=2,
            color=color,
            label=engine,
        )
    thr.plot([], [], ls="--", color="gray", label="ideal: N x same engine at N=1")
    eff.axhline(100, color="gray", ls="--", lw=1)
    if all(p.efficiency is None for p in result.points):  # say why the panel is empty
        where = (
            "ran on the rendezvous store's host"
            if result.config.nnodes
            else "was not measured (add 1 to --nproc)"
        )
        eff.text(
            0.5, 0.5, f"no efficiency: the 1-worker baseline\n{where}", ha="center", transform=eff.transAxes
        )
    for ax, ylabel in ((thr, "samples/s (all workers)"), (eff, "scaling efficiency (% of linear)")):
        ax.set_xticks(sizes, [str(n) for n in sizes])
        threads = result.config.threads_per_worker
        each = f"{threads} intra-op thread{'s' if threads > 1 else ''} each"
        ax.set(xlabel=f"workers N ({each})", ylabel=ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.35)
        ax.legend(loc="lower left", fontsize="small")
    name = shlex.join([Path(result.config.script).name, *result.config.args])
    fig.suptitle(f"dpscale scale: {name}", fontsize="medium")
    return fig


def warnings(result: ScaleResult) -> list[str]:
    """The trust checks (bench/trust.py) on the points' step-time spread."""
    return timing_warnings({**asdict(p), "spread": p.spread} for p in result.points)


def write_report(result: ScaleResult, report: ReportDir) -> None:
    """report.json, scale.csv, scale.png, profile.json (when measured) and report.md."""
    doc = result.to_dict()
    report.write_json(doc, config=doc["config"])
    report.write_csv("scale", doc["points"])
    report.save_figure(plot(result), "scale")
    blocks = []
    if result.profile is not None:
        write_no_follow(report.path / "profile.json", json.dumps(result.profile, indent=2) + "\n")
        blocks = [
            "profile.json is dpscale's one-worker run as a `dpscale predict` profile: "
            f"`dpscale predict --profile {report.path / 'profile.json'} --preset dgx-a100`."
        ]
    c = result.config
    method = (
        f"`{_command(result)}` ran unchanged under `dpscale run` at each world size with each engine; "
        f"after {c.warmup} warm-up synchronized steps, {c.steps} were timed, then the script was stopped "
        "cleanly at the same step on every rank. A step runs from its first training forward to the next "
        "step's (backward, optimizer, data loading included) and counts at its slowest rank; samples are "
        "dim 0 of the DDP module's first tensor input, over the step's micro-steps and all ranks."
    )
    if c.nnodes is not None:
        method += (
            f" Across {c.nnodes} hosts: each N > 1 ran as one job of {c.nnodes} hosts x N/{c.nnodes} workers "
            "(every rank's telemetry gathered inside the job); the 1-worker baseline that efficiency divides "
            "by ran on one host, the one serving the rendezvous store (the other hosts report no efficiency)."
        )
    definitions = (
        "efficiency = samples/s(N) / (N x samples/s(1)), same engine; exposed = communication not hidden "
        "behind backward, median over steps on rank 0 (dpscale: the engine's own stats; torch: from the "
        "last bucket's launch to the last reduction's completion, through a timing comm hook)."
    )
    formats = {k: f for k, (_, f) in _COLUMNS.items() if f}
    headers = {k: h for k, (h, _) in _COLUMNS.items()}
    report.write_markdown(
        "Scaling of your script",
        [
            Section("Results", [method, definitions, Table(doc["points"], list(_COLUMNS), formats, headers)]),
            Section("Plot", [Image("scale.png", "throughput and efficiency vs workers"), *blocks]),
        ],
        warnings=warnings(result),
    )


def _setup(results: dict) -> tuple[set[str], set[str]]:
    """The script measured and the batches used, for `dpscale report A B`."""
    config = results.get("config") or {}
    script = " ".join([config.get("script", "?"), *config.get("args", [])])
    batch = values(*(f"{p['samples_per_step'] / p['world_size']:g}/worker" for p in results["points"]))
    return {script}, batch


BENCH = Bench(  # no study part: its reports keep the user's own command line
    command="scale",
    argv=("scale",),
    help="measure how your own torchrun script scales: step time, samples/s, efficiency, exposed comm",
    Config=ScaleConfig,
    run=script_scaling.measure,  # (config, the directory its logs go to): cli/bench.py keeps them
    from_dict=ScaleResult.from_dict,
    write_report=write_report,
    # rows matched on engine, world_size -> samples_per_s, efficiency
    compare=Figures(("engine", "world_size"), (), ("samples_per_s", "efficiency"), points, _setup),
    text=lambda result: [format_table(result)],
    json_line=lambda result: json.dumps(result.rows(), allow_nan=False),
    warnings=warnings,
)
