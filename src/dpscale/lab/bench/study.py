"""`dpscale study`, the main job: how well does data parallelism scale on this machine?

Runs the benches on the built-in workloads — the all-reduce sweep (every CPU transport), the
weak-scaling comparison (dpscale vs torch DDP vs the unsynchronized ceiling), the convergence
check, and time to a target as the global batch grows with N (`bench convergence --mode weak`,
per model and engine that can train) — and writes one combined report: each bench's own report in
a subdirectory (re-renderable with `dpscale report`), plus a top-level report.md with the summary
table and the key plots. `--quick` shrinks every bench to fit a test's budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dpscale.engine.factory import TRAIN_ENGINES
from dpscale.errors import ConfigError
from dpscale.flags import flag_spec, unchecked_config
from dpscale.lab.bench import (
    allreduce,
    allreduce_report,
    convergence,
    convergence_report,
    scaling,
    scaling_report,
    study_summary,
    weak,
    weak_report,
)
from dpscale.lab.bench.args import parse_int_list
from dpscale.lab.bench.bench import Bench, Figures, values
from dpscale.lab.bench.report import Image, ReportDir, Section, Table
from dpscale.lab.bench.study_summary import summary_rows
from dpscale.lab.bench.trust import timing_warnings
from dpscale.lab.recipe import load_recipe
from dpscale.log import get_logger

logger = get_logger(__name__)

TRANSPORTS = ["shm", "gloo"]
MiB = 1 << 20
# Time-to-target targets per built-in model, (full, quick), that N=1 at the workload's batch
# reaches in about an epoch (digits: 3,300 samples to 0.9; the transformer, judged on its training
# loss as it has no eval set: ~800 samples to 1.0). The mlp has none: its loss stays at ln 10 for
# the first two epochs at its rate, 0.01, so it would cost minutes to say nothing.
WEAK_TARGETS: dict[str, tuple[dict, dict]] = {
    "digits": ({"target_metric": "accuracy=0.9"}, {"target_metric": "accuracy=0.8"}),
    "transformer": ({"target_loss": 1.0}, {"target_loss": 2.5}),
}
WEAK_COMMAND = weak_report.BENCH.command  # the report command of `bench convergence --mode weak`
QUICK_NOTE = (
    "indicative only: --quick times few steps and small sizes; run `dpscale study` without --quick "
    "for figures to quote"
)


@dataclass(kw_only=True, frozen=True)
class StudyConfig:
    quick: bool = False
    """Small sizes, few steps (under 90 s)."""
    models: tuple[str, ...] = field(
        default=("mlp", "transformer"),
        metadata=flag_spec(parse=lambda s: tuple(m for m in s.split(",") if m)),
    )
    """Models for weak scaling: built-in workloads or module:callable returning a dpscale.Task
    (--quick uses the first only)."""
    world_sizes: tuple[int, ...] = field(
        default=(1, 2),
        metadata=flag_spec(
            name="--nproc",
            deprecated=("--world-sizes",),
            parse=lambda s: tuple(parse_int_list(s, flag="--nproc", minimum=1)),
        ),
    )
    """Worker counts to compare."""
    report_dir: str = "reports"
    """Base directory for the report."""

    def __post_init__(self) -> None:
        if not self.models:
            raise ConfigError("--models: name at least one built-in model, e.g. mlp")
        for m in self.models:
            load_recipe(m, "--models", check=True)  # a broken task fails before the study starts

    def allreduce_config(self) -> allreduce.AllReduceConfig:
        sizes = [4, 4096, MiB, 16 * MiB] if self.quick else [4 * 4**i for i in range(13)]  # 4 B .. 64 MiB
        return allreduce.AllReduceConfig(
            transports=TRANSPORTS,
            world_sizes=list(self.world_sizes),
            sizes_bytes=sizes,
            iters=10 if self.quick else None,
        )

    def scaling_configs(self) -> list[scaling.ScalingConfig]:
        models = self.models[:1] if self.quick else self.models
        return [
            scaling.ScalingConfig(
                model=m, mode="weak", world_sizes=list(self.world_sizes), steps=10 if self.quick else 30
            )
            for m in models
        ]

    def weak_configs(self) -> list[weak.WeakConfig]:
        """Time to target for the convergence check's workload (digits) with dpscale's engine, and
        for each weak-scaling model that has a target with every engine that can train (--quick:
        dpscale's only). None without N=1 among the world sizes: the ratios need it."""
        if 1 not in self.world_sizes:
            return []
        models = self.models[:1] if self.quick else self.models
        plan = [("digits", "dpscale")] + [
            (m, e)
            for m in models
            if m in WEAK_TARGETS
            for e in (("dpscale",) if self.quick else TRAIN_ENGINES)
        ]
        return [
            weak.WeakConfig(
                workload=m,
                world_sizes=list(self.world_sizes),
                engine=e,
                lr_rule="sqrt",
                **WEAK_TARGETS[m][1 if self.quick else 0],
            )
            for m, e in dict.fromkeys(plan)
        ]

    def convergence_config(self) -> convergence.ConvergenceConfig:
        # digits' 1,438 training samples: 2 epochs quick, 10 full
        return convergence.ConvergenceConfig(
            workload="digits",
            world_sizes=list(self.world_sizes),
            samples=2 * 1438 if self.quick else 10 * 1438,
        )


@dataclass
class StudyResult:
    config: StudyConfig
    allreduce: allreduce.AllReduceResult
    scaling: list[scaling.ScalingResult]
    convergence: convergence.ConvergenceResult
    wall_s: float
    weak: list[weak.WeakResult] = field(default_factory=list)

    def summary(self) -> list[dict]:
        """One row per (model, engine, world size) a bench ran, with its own figures (study_summary.py)."""
        return summary_rows(self.allreduce, self.scaling, self.convergence, self.weak)

    def warnings(self) -> list[str]:
        """The trust checks on the summary and on each weak-scaling run (bench/trust.py); a --quick
        study says it is indicative."""
        quick = [QUICK_NOTE] if self.config.quick else []
        return (
            quick + timing_warnings(self.summary()) + [w for r in self.weak for w in weak_report.warnings(r)]
        )

    @classmethod
    def from_dict(cls, doc: dict) -> StudyResult:
        """Rebuild from `to_dict()` output (report.json's "results"), e.g. to re-render a report."""
        config = unchecked_config(StudyConfig, doc["config"])  # its user models need not import now
        return cls(
            config,
            allreduce.AllReduceResult.from_dict(doc["allreduce"]),
            [scaling.ScalingResult.from_dict(r) for r in doc["scaling"]],
            convergence.ConvergenceResult.from_dict(doc["convergence"]),
            doc["wall_s"],
            [weak.WeakResult.from_dict(r) for r in doc.get("weak", [])],  # none before time to target
        )

    def to_dict(self) -> dict:
        return {
            "config": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(self.config).items()},
            "summary": self.summary(),
            "allreduce": self.allreduce.to_dict(),
            "scaling": [r.to_dict() for r in self.scaling],
            "convergence": self.convergence.to_dict(),
            "weak": [r.to_dict() for r in self.weak],
            "wall_s": self.wall_s,
        }


def _say(text: str) -> None:
    logger.info("%s", text)


def run(config: StudyConfig) -> StudyResult:
    t0 = time.perf_counter()
    _say(f"study 1/4: all-reduce sweep, transports {','.join(TRANSPORTS)}, world sizes {config.world_sizes}")
    ar = allreduce.run(config.allreduce_config())
    sc = []
    for i, cfg in enumerate(config.scaling_configs()):
        _say(
            f"study 2/4: weak scaling of {cfg.model} ({i + 1}/{len(config.scaling_configs())}), "
            f"engines {','.join(cfg.engines)}"
        )
        sc.append(scaling.run(cfg))
    cv_cfg = config.convergence_config()
    _say(f"study 3/4: convergence of {cv_cfg.workload} at world sizes {cv_cfg.world_sizes}")
    cv = convergence.run(cv_cfg)
    wk = []
    for wc in config.weak_configs():
        target = wc.target_metric or f"loss {wc.target_loss}"
        ns = ",".join(map(str, wc.world_sizes))
        _say(f"study 4/4: time to target ({target}) of {wc.workload} with {wc.engine} at N={ns}")
        wk.append(weak.run(wc))
    return StudyResult(config, ar, sc, cv, time.perf_counter() - t0, wk)


def format_summary(result: StudyResult) -> str:
    return study_summary.format_summary(result.summary())


# the benches a study runs, by report command: each part's report is theirs
PARTS: dict[str, Bench] = {
    b.command: b
    for b in (allreduce_report.BENCH, scaling_report.BENCH, convergence_report.BENCH, weak_report.BENCH)
}


def part_argv(command: str, config: object) -> list[str]:
    """The `dpscale bench COMMAND ...` line that runs one part of a study on its own, exactly."""
    return PARTS[command].command_line(config)


def _part(parent: ReportDir, folder: str, kind: Bench, result, quick: bool) -> str:
    """Write one bench's report into `folder` under the study's; returns the folder's name."""
    path = parent.path / folder
    path.mkdir(exist_ok=True)  # `dpscale report` re-renders the parts in place
    notes = (QUICK_NOTE,) if quick else ()  # a --quick study's parts are indicative too
    argv = kind.command_line(result.config)
    kind.write_report(result, ReportDir(path, kind.command, argv, parent.system, notes))
    return folder


def write_report(result: StudyResult, report: ReportDir) -> None:
    """The combined report: each bench in its own subdirectory, the summary on top."""
    quick = bool(result.config.quick)
    _part(report, "allreduce", allreduce_report.BENCH, result.allreduce, quick)
    images = [Image("allreduce/allreduce_busbw.png", "all-reduce bus bandwidth vs message size")]
    for res in result.scaling:
        # a task spec's colon cannot name a folder
        sub = _part(report, f"scaling-{res.config.model.replace(':', '-')}", scaling_report.BENCH, res, quick)
        images.append(Image(f"{sub}/scaling_efficiency.png", f"scaling efficiency, {res.config.model}"))
    _part(report, "convergence", convergence_report.BENCH, result.convergence, quick)
    images.append(Image("convergence/convergence.png", "loss vs samples seen per world size"))
    for weak_res in result.weak:
        name = f"weak-{weak_res.config.workload}-{weak_res.config.engine}"
        sub = _part(report, name, weak_report.BENCH, weak_res, quick)
        images.append(Image(f"{sub}/weak_speedup.png", f"time-to-target speed-up, {sub}"))
    doc = result.to_dict()
    report.write_json(doc, config=doc["config"])
    report.write_csv("summary", doc["summary"])
    details = "Each bench's full report, re-renderable with `dpscale report DIR`: " + ", ".join(
        f"[{p.name}]({p.name}/report.md)" for p in sorted(report.path.iterdir()) if p.is_dir()
    )
    report.write_markdown(
        "dpscale study",
        [
            Section(
                "Summary",
                [
                    Table(
                        doc["summary"],
                        study_summary.COLUMNS,
                        study_summary.FORMATS,
                        study_summary.HEADERS,
                        study_summary.missing_text,
                    ),
                    study_summary.READING,
                    f"Wall time: {result.wall_s:.0f} s.",
                ],
            ),
            Section("Plots", images),
            Section("Details", [details]),
        ],
        warnings=result.warnings(),
    )


def _setup(results: dict) -> tuple[set[str], set[str]]:
    """The models measured and the batches used, for `dpscale report A B`."""
    batch = values(*(f"{r['config'].get('per_worker_batch')}/worker" for r in results.get("scaling", [])))
    return values(*(r.get("model") for r in results["summary"])), batch


# rows matched on model, engine, world_size (+ transport) -> samples_per_s, efficiency (summary rows)
FIGURES = Figures(
    ("model", "engine", "world_size"),
    ("transport",),
    ("samples_per_s", "efficiency"),
    lambda r: r["summary"],
    _setup,
)
