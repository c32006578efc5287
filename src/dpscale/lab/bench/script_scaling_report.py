"""Rendering of `dpscale scale` results: the terminal table, one plot and the report directory.

Everything works from a `ScaleResult` alone, so `dpscale report DIR` re-renders an old run.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict
from pathlib import Path

from dpscale.lab.bench import script_diagnosis, script_scaling
from dpscale.lab.bench.bench import Bench, Figures, points, values
from dpscale.lab.bench.report import Image, ReportDir, Section, Table, new_figure, text_table
from dpscale.lab.bench.script_phases import RANK_PHASES
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
    "note": ("note", ""),
}
_PHASE_HEADERS = {
    "micro_steps_ms": "micro-steps",
    "forward_ms": "forward",
    "backward_ms": "backward",
    "exposed_comm_ms": "exposed comm",
    "optimizer_ms": "optimizer",
    "data_wait_ms": "data wait",
    "idle_ms": "idle at end",
}
_NESTED = ("phases", "stragglers")  # per-rank lists: phases.csv and the breakdown, not scale.csv


def _command(result: ScaleResult) -> str:
    return shlex.join([result.config.script, *result.config.args])


def format_table(result: ScaleResult) -> str:
    """The points as a fixed-width terminal table (the report's table, same cells)."""
    formats = {k: f for k, (_, f) in _COLUMNS.items() if f}
    headers = {k: h for k, (h, _) in _COLUMNS.items()}
    table = text_table([asdict(p) for p in result.points], list(_COLUMNS), formats, headers)
    return "\n".join([f"scaling of {_command(result)}", table, *diagnosis(result)])


def phase_rows(result: ScaleResult) -> list[dict]:
    """One row per point, rank and statistic (median, p90): each phase in ms, and `step_ms` their sum."""
    rows = []
    for p in result.points:
        for rank in p.phases or []:
            for stat in ("median", "p90"):
                phases = rank[stat]
                rows.append(
                    {
                        "engine": p.engine,
                        "world_size": p.world_size,
                        "rank": rank["rank"],
                        "stat": stat,
                        **{k: phases[k] for k in RANK_PHASES},
                        "step_ms": sum(phases[k] for k in RANK_PHASES),
                        "sum_error": rank["sum_error"],
                    }
                )
    return rows


def diagnosis(result: ScaleResult) -> list[str]:
    """Where each N's efficiency went, then the script's checks, the ranked causes with the fix to
    try and, with --try, predicted beside measured (script_diagnosis.py)."""
    lines = []
    for p in result.points:
        if p.lost_points is not None:
            ranked = sorted(p.lost_points.items(), key=lambda kv: -abs(kv[1]))
            parts = ", ".join(f"{name} {pts:.1f}" for name, pts in ranked)
            lost = sum(p.lost_points.values())
            lines.append(f"N={p.world_size} ({p.engine}): {lost:.1f} efficiency points lost: {parts}")
    return lines + script_diagnosis.render(result)


def plot_phases(result: ScaleResult):
    """Per measured point a panel: one stacked bar per rank of its median phases."""
    pts = [p for p in result.points if p.phases]
    fig = new_figure(max(5.0, 3.2 * len(pts)), 4.5)
    axes = fig.subplots(1, max(1, len(pts)), squeeze=False)[0]
    for ax, p in zip(axes, pts, strict=False):
        ranks = [r["rank"] for r in p.phases or []]
        bottom = [0.0] * len(ranks)
        for i, name in enumerate(RANK_PHASES):
            heights = [r["median"][name] for r in p.phases or []]
            ax.bar(ranks, heights, bottom=bottom, color=f"C{i}", label=_PHASE_HEADERS[name])
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.set_xticks(ranks, [str(r) for r in ranks])
        ax.set(xlabel="rank", ylabel="ms per step (medians)", title=f"N={p.world_size} ({p.engine})")
        ax.grid(True, axis="y", alpha=0.35)
    if pts:
        axes[0].legend(loc="lower left", fontsize="x-small")
    fig.suptitle(f"where each rank's step goes: {Path(result.config.script).name}", fontsize="medium")
    return fig


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
    report.write_csv("scale", [{k: v for k, v in p.items() if k not in _NESTED} for p in doc["points"]])
    report.save_figure(plot(result), "scale")
    phases = phase_rows(result)
    phase_blocks: list = ["Not measured: no step had a backward the worker saw."]
    if phases:
        report.write_csv("phases", phases)
        report.save_figure(plot_phases(result), "phases")
        columns = ["world_size", "engine", "rank", "stat", *RANK_PHASES, "step_ms"]
        headers = {"world_size": "N", **_PHASE_HEADERS, "step_ms": "sum"}
        phase_blocks = [
            "Each rank's step, split (medians and p90 over the timed steps; phases.csv): the accumulation "
            "micro-steps before the synced one, the synced forward (to its backward's start), backward less "
            "the communication it waited for, that exposed communication, the optimizer, the wait for the "
            "next step's first forward (its data, the script's own work) and the idle time at the end, "
            "waiting for the slowest rank's step. The phases add up to the counted step.",
            Table(phases, columns, dict.fromkeys([*RANK_PHASES, "step_ms"], ".2f"), headers),
            Image("phases.png", "each rank's step by phase, per world size"),
        ]
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
        "dim 0 of the DDP module's first tensor input, over the step's micro-steps and all ranks. A rank "
        "without a DDP model is measured from its top-level model, each step ended by its optimizer "
        "step. "
        "Steps are compared per optimizer step; steps that held an evaluation or a checkpoint are counted "
        "apart (the row's note), not in the step figures."
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
            Section("Where each step goes", phase_blocks),
            Section("Diagnosis", _diagnosis_blocks(result)),
        ],
        warnings=warnings(result),
    )


def _diagnosis_blocks(result: ScaleResult) -> list:
    lines = diagnosis(result)
    if not lines:
        return ["Nothing found: no check fired and no cause cost 0.5 efficiency points or more."]
    return [
        "The script's checks, then the causes of lost efficiency, largest first, each with its cost "
        "and the fix to try. A gain marked predicted is `dpscale predict`'s, from the profile measured "
        "at N=1 on this machine's links; `--try` measures it.",
        "\n".join(f"- {line}" for line in lines),
    ]


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
