"""The lab's commands: each bench's flags, how they become its config, and what the command prints.

Measurement modules (allreduce.py, scaling.py, convergence.py, engine.py) hold a Config, a Result
and `run`; `*_report.py` render a Result; this module wires them to the command line and is the
only one here that imports both sides, so rendering never reaches back into argument handling.
A bench is one `command.Bench` (which results it prints, which report it writes); the shape they
share runs there. `COMMANDS` is the list the CLI registers, in the order `dpscale --help` shows them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from dpscale.cores import usable_cores
from dpscale.errors import ConfigError
from dpscale.flags import add_dataclass_arguments, dataclass_kwargs, flag_name, flag_spec
from dpscale.lab.bench import (
    allreduce,
    allreduce_report,
    compare,
    convergence,
    convergence_report,
    kinds,
    rerender,
    scaling,
    scaling_report,
    script_scaling,
    script_scaling_report,
    study,
    transports,
    weak,
    weak_report,
)
from dpscale.lab.bench import engines as engine
from dpscale.lab.bench.command import Bench, Command, add_config_flag, add_output_flags, config_kwargs, warn
from dpscale.lab.bench.report import ReportDir, require_plots
from dpscale.launch.run import check_script
from dpscale.paths import check_writable_dir

# ---- all-reduce ---------------------------------------------------------------------------------


def add_allreduce_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(parser, allreduce.AllReduceConfig)
    add_output_flags(parser, "print the points as JSON on the last line of stdout")


def allreduce_config(args: argparse.Namespace) -> allreduce.AllReduceConfig:
    kwargs = config_kwargs(args, allreduce.AllReduceConfig)
    kwargs.setdefault("transports", transports.available_transports())  # not just gloo, as the API's
    return allreduce.AllReduceConfig(**kwargs)


run_allreduce = Bench(
    name="bench allreduce",
    kind=kinds.ALLREDUCE,
    config=allreduce_config,
    measure=lambda config: allreduce.run(config),
    text=lambda result: [
        allreduce_report.format_table(result),
        allreduce.BUSBW_CONVENTION,
        allreduce_report.format_fits(result),
    ],
    json_line=lambda result: json.dumps([p.to_dict() for p in result.points]),
    warnings=allreduce_report.warnings,
)


# ---- scaling ------------------------------------------------------------------------------------


def add_scaling_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(parser, scaling.ScalingConfig)
    add_output_flags(parser, "print the points as JSON on the last line of stdout")


def scaling_config(args: argparse.Namespace) -> scaling.ScalingConfig:
    return scaling.ScalingConfig(**config_kwargs(args, scaling.ScalingConfig))


run_scaling = Bench(
    name="bench scaling",
    kind=kinds.SCALING,
    config=scaling_config,
    measure=lambda config: scaling.run(config),
    text=lambda result: [scaling_report.format_table(result)],
    json_line=lambda result: json.dumps([asdict(p) for p in result.points], allow_nan=False),
    warnings=scaling_report.warnings,
)


# ---- convergence --------------------------------------------------------------------------------


CONVERGENCE_MODES = ("same-batch", "weak")
_SHARED_CONVERGENCE_FIELDS = tuple(f.name for f in fields(convergence.TrainingRunsConfig))


@dataclass(frozen=True, kw_only=True)
class ConvergenceMode:
    """Which experiment `bench convergence` runs; each mode has a config of its own (below)."""

    mode: str = field(
        default="same-batch",
        metadata=flag_spec(
            choices=CONVERGENCE_MODES,
            help="same-batch: the loss curve at every world size must equal W=1's (a correctness check); "
            "weak: the global batch grows with N, time to a target per N (default same-batch)",
        ),
    )
    """same-batch: ConvergenceConfig; weak: WeakConfig."""

    def __post_init__(self) -> None:
        if self.mode not in CONVERGENCE_MODES:
            raise ConfigError(f"--mode: unknown {self.mode!r}; choose one of {', '.join(CONVERGENCE_MODES)}")


def add_convergence_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(parser, ConvergenceMode)
    add_dataclass_arguments(parser, convergence.ConvergenceConfig)
    add_dataclass_arguments(parser, weak.WeakConfig, skip=_SHARED_CONVERGENCE_FIELDS)
    add_output_flags(parser, "print one object per world size as JSON on the last line")


def _refuse_other_mode_flags(args: argparse.Namespace, mode: str, other: type) -> None:
    """A flag of the other mode's config would be silently ignored: refuse it, naming the flag."""
    mine = {f.name for f in fields(weak.WeakConfig if mode == "weak" else convergence.ConvergenceConfig)}
    for f in fields(other):
        if f.name not in mine and getattr(args, f.name, None) is not None:
            raise ConfigError(
                f"{flag_name(f)}: not a flag of --mode {mode}; drop it or choose the other mode"
            )


def convergence_config(args: argparse.Namespace) -> convergence.ConvergenceConfig:
    _refuse_other_mode_flags(args, "same-batch", weak.WeakConfig)
    return convergence.ConvergenceConfig(**config_kwargs(args, convergence.ConvergenceConfig))


def weak_config(args: argparse.Namespace) -> weak.WeakConfig:
    _refuse_other_mode_flags(args, "weak", convergence.ConvergenceConfig)
    return weak.WeakConfig(**config_kwargs(args, weak.WeakConfig))


def _convergence_text(result: convergence.ConvergenceResult) -> list[str]:
    lines = [convergence_report.format_table(result)]
    if result.config.compression != "none":
        ref = result.reference.world_size
        lines.append(
            f"compression: {result.config.compression} at every world size but {ref} (uncompressed reference)"
        )
    return [*lines, convergence_report.largest_gap_text(result)]


_same_batch = Bench(
    name="bench convergence",
    kind=kinds.CONVERGENCE,
    config=convergence_config,
    measure=lambda config: convergence.run(config),
    text=_convergence_text,
    json_line=lambda result: json.dumps(result.summary()),
    # exit 1 when a world size departs from the reference beyond the tolerance
    exit_code=lambda result: 0 if all(r.within_tolerance for r in result.runs) else 1,
)
_weak = Bench(
    name="bench convergence",
    kind=kinds.WEAK,
    config=weak_config,
    measure=lambda config: weak.run(config),
    text=lambda result: [weak_report.format_table(result), weak_report.findings_text(result)],
    json_line=lambda result: json.dumps(result.summary()),
    warnings=weak_report.warnings,
    exit_code=lambda result: 0 if result.reference.reached else 1,  # the ratios need N=1's time
)


def run_convergence(args: argparse.Namespace) -> int:
    """Same-batch: exit 0 when every world size is within tolerance, 1 when one departs.
    Weak: exit 0 when N=1 reached the target (the ratios need it), 1 when it did not."""
    mode = ConvergenceMode(**dataclass_kwargs(args, ConvergenceMode)).mode
    return (_weak if mode == "weak" else _same_batch)(args)


# ---- engine -------------------------------------------------------------------------------------


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(parser, engine.EngineBenchConfig)
    add_output_flags(parser, "print the results as a JSON list on the last line", report_help="reports")


def run_engine(args: argparse.Namespace) -> int:
    require_plots("bench engine")
    check_writable_dir("--report-dir", args.report_dir)
    config = engine.EngineBenchConfig(**config_kwargs(args, engine.EngineBenchConfig))
    results = []
    for m in config.models:
        res, measured = engine.run(
            m, config.world_size, config.per_worker_batch, config.engines, config.steps
        )
        print(engine.format_result(res), flush=True)
        warn(scaling_report.warnings(measured))
        # the per-step measurements, as a scaling report: `dpscale report` re-renders and compares it
        report = ReportDir.create(args.report_dir, kinds.SCALING.command)
        kinds.SCALING.write_report(measured, report)
        print(f"report: {report.path}", flush=True)
        results.append(res.to_dict())
    if args.json:
        print(json.dumps(results))
    return 0


# ---- study and report ---------------------------------------------------------------------------


def add_study_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(parser, study.StudyConfig)
    add_config_flag(parser)
    parser.add_argument("--json", action="store_true", help="print the summary rows as JSON on the last line")


def study_config(args: argparse.Namespace) -> study.StudyConfig:
    return study.StudyConfig(**config_kwargs(args, study.StudyConfig))


def run_study(args: argparse.Namespace) -> int:
    require_plots("study")
    config = study_config(args)
    check_writable_dir("--report-dir", config.report_dir)
    result = study.run(config)
    report = ReportDir.create(config.report_dir, "study")
    study.write_report(result, report)
    print(study.format_summary(result))
    warn(result.warnings())
    print(f"report: {report.path / 'report.md'}  ({result.wall_s:.0f} s)")
    if args.json:
        print(json.dumps(result.summary()))
    return 0


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dirs",
        nargs="+",
        metavar="DIR",
        help="one report directory to re-render, or two or more to compare (the first is the baseline A)",
    )
    add_dataclass_arguments(parser, compare.ReportConfig, skip=("dirs",))


def run_report(args: argparse.Namespace) -> int:
    config = compare.ReportConfig(**dataclass_kwargs(args, compare.ReportConfig) | {"dirs": tuple(args.dirs)})
    if len(config.dirs) == 1:
        require_plots("report")  # a comparison draws nothing
        print(f"re-rendered {rerender.rerender(config.dirs[0])}")
        return 0
    if config.out is not None:
        check_writable_dir("--out", config.out)  # before the table is printed, not after
    comparison = compare.compare(config.dirs)
    print(compare.format_comparison(comparison))
    path = compare.write_comparison(comparison, compare.output_dir(config.dirs[0], config.out))
    print(f"report: {path.parent}")
    return 0


# ---- scale (your own torchrun script) ----------------------------------------------------------


def add_scale_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(parser, script_scaling.ScaleConfig, skip=("script", "args"))
    add_output_flags(parser, "print one list of rows on the last line of stdout")
    parser.add_argument(
        "script_command", nargs=argparse.REMAINDER, metavar="-- SCRIPT [ARGS...]", help="your training script"
    )


def scale_config(args: argparse.Namespace) -> script_scaling.ScaleConfig:
    command = args.script_command
    command = command[1:] if command[:1] == ["--"] else command
    if not command:
        raise ConfigError("give the script after --, e.g. dpscale scale --nproc 1,2 -- train.py --lr 0.1")
    check_script(command[0])
    kwargs = config_kwargs(args, script_scaling.ScaleConfig)
    sizes = kwargs.get("world_sizes", [1, 2])
    # across hosts, N / hosts workers share one host's cores
    per_host = max(sizes) // (kwargs.get("nnodes") or 1)
    kwargs.setdefault("threads_per_worker", max(1, usable_cores() // max(1, per_host)))
    return script_scaling.ScaleConfig(script=command[0], args=command[1:], **kwargs)


def run_scale(args: argparse.Namespace) -> int:
    require_plots("scale")
    config = scale_config(args)
    check_writable_dir("--report-dir", args.report_dir)
    with tempfile.TemporaryDirectory(prefix="dpscale-scale-logs-") as logs:
        try:
            result = script_scaling.measure(config, Path(logs))
        except script_scaling.ScriptFailed as e:  # the script's own failure: not bad input, so exit 1
            print(f"dpscale scale: error: {e}", file=sys.stderr, flush=True)
            return 1
        report = ReportDir.create(args.report_dir, kinds.SCALE.command)  # only now: nothing half-written
        for log in Path(logs).glob("*.log"):
            shutil.copy(log, report.path / log.name)
    print(script_scaling_report.format_table(result))
    warn(script_scaling_report.warnings(result))
    kinds.SCALE.write_report(result, report)
    print(f"report: {report.path}")
    if args.json:
        print(json.dumps(result.rows(), allow_nan=False))
    return 0


COMMANDS = [
    Command(
        "bench",
        "allreduce",
        "all-reduce time and bandwidth vs message size, world size and transport",
        add_allreduce_arguments,
        run_allreduce,
    ),
    Command(
        "bench",
        "scaling",
        "throughput and scaling efficiency: dpscale vs torch DDP vs no synchronization",
        add_scaling_arguments,
        run_scaling,
    ),
    Command(
        "bench",
        "convergence",
        "loss curves at several world sizes with the same global batch; "
        "--mode weak: time to a target as the batch grows with N",
        add_convergence_arguments,
        run_convergence,
    ),
    Command(
        "bench",
        "engine",
        "step time of dpscale vs torch DDP vs no synchronization, alternating",
        add_engine_arguments,
        run_engine,
    ),
    Command(
        None,
        "study",
        "the main job: all-reduce, weak scaling and convergence, one report",
        add_study_arguments,
        run_study,
    ),
    Command(
        None,
        "report",
        "re-render one report directory, or compare several (A/B)",
        add_report_arguments,
        run_report,
    ),
    Command(
        None,
        "scale",
        "measure how your own torchrun script scales: step time, samples/s, efficiency, exposed comm",
        add_scale_arguments,
        run_scale,
    ),
]


def main(argv: list[str] | None = None, *, name: str = "engine") -> int:
    """Run one bench outside the `dpscale` CLI (benchmarks/engine.py)."""
    command = next(c for c in COMMANDS if c.name == name)
    parser = argparse.ArgumentParser(description=command.help)
    command.add_arguments(parser)
    return command.run(parser.parse_args(argv))
