"""`dpscale bench ...`, `dpscale scale`: the benches' flags and the one shape every bench runs in.

Each bench (lab/bench/bench.py, listed in benches.py) gives its Config, whose fields are its flags;
`run_bench` takes the config from the flags (and --config FILE.toml), measures, prints the results
and warnings, writes the report, then the --json line last. Three commands keep runners of their
own because their shape differs: `bench convergence` picks one of two benches by --mode, `bench
engine` writes one report per model as it goes, and `scale` keeps its script's logs in the report
and tells the script's own failure (exit 1) from bad input.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dpscale.cores import usable_cores
from dpscale.errors import ConfigError
from dpscale.flags import add_dataclass_arguments, config_kwargs, dataclass_kwargs, flag_name, flag_spec
from dpscale.lab.bench import (
    convergence,
    convergence_report,
    scaling_report,
    script_scaling,
    script_scaling_report,
    weak,
    weak_report,
)
from dpscale.lab.bench import engines as engine
from dpscale.lab.bench.bench import Bench
from dpscale.lab.bench.benches import BENCHES
from dpscale.lab.bench.report import ReportDir, require_plots
from dpscale.launch.run import check_script
from dpscale.paths import check_writable_dir


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE.toml",
        default=None,
        help="set any of the fields below from a TOML file (keys as the flags, without --); flags override",
    )


def add_output_flags(parser: argparse.ArgumentParser, json_help: str, report_help: str = "report") -> None:
    """The flags every bench has besides its config's: the config file, where the report goes,
    JSON on stdout."""
    add_config_flag(parser)
    parser.add_argument("--json", action="store_true", help=json_help)
    parser.add_argument(
        "--report-dir", default="reports", help=f"base directory of the {report_help} (default reports)"
    )


def warn(warnings: list[str]) -> None:
    """The trust checks' lines (bench/trust.py), on stderr so a --json line stays last on stdout."""
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr, flush=True)


def bench_config(bench: Bench, args: argparse.Namespace) -> Any:
    """The bench's config: its command's defaults, then --config FILE.toml, then the flags given."""
    return bench.Config(**(bench.defaults() | config_kwargs(args, bench.Config)))


def run_bench(bench: Bench, args: argparse.Namespace, config: Any = None) -> int:
    """Measure, print the results, warn, write the report, then the --json line: the same for all."""
    require_plots(" ".join(bench.argv[:2]))
    check_writable_dir("--report-dir", args.report_dir)  # before measuring, not after
    result = bench.run(bench_config(bench, args) if config is None else config)
    print("\n".join(bench.text(result)))
    warn(bench.warnings(result))
    report = ReportDir.create(args.report_dir, bench.command)
    bench.write_report(result, report)
    print(f"report: {report.path}")
    if args.json:
        print(bench.json_line(result))
    return bench.exit_code(result)


def add_bench_arguments(bench: Bench, parser: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(parser, bench.Config)
    add_output_flags(parser, "print the points as JSON on the last line of stdout")


# ---- convergence: two benches behind --mode ----------------------------------------------------


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
    return bench_config(convergence_report.BENCH, args)


def weak_config(args: argparse.Namespace) -> weak.WeakConfig:
    _refuse_other_mode_flags(args, "weak", convergence.ConvergenceConfig)
    return bench_config(weak_report.BENCH, args)


def run_convergence(args: argparse.Namespace) -> int:
    """Same-batch: exit 0 when every world size is within tolerance, 1 when one departs.
    Weak: exit 0 when N=1 reached the target (the ratios need it), 1 when it did not."""
    mode = ConvergenceMode(**dataclass_kwargs(args, ConvergenceMode)).mode
    if mode == "weak":
        return run_bench(weak_report.BENCH, args, weak_config(args))
    return run_bench(convergence_report.BENCH, args, convergence_config(args))


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
        report = ReportDir.create(args.report_dir, scaling_report.BENCH.command)
        scaling_report.BENCH.write_report(measured, report)
        print(f"report: {report.path}", flush=True)
        results.append(res.to_dict())
    if args.json:
        print(json.dumps(results))
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
    bench = script_scaling_report.BENCH
    require_plots("scale")
    config = scale_config(args)
    check_writable_dir("--report-dir", args.report_dir)
    with tempfile.TemporaryDirectory(prefix="dpscale-scale-logs-") as logs:
        try:
            result = bench.run(config, Path(logs))
        except script_scaling.ScriptFailed as e:  # the script's own failure: not bad input, so exit 1
            print(f"dpscale scale: error: {e}", file=sys.stderr, flush=True)
            return 1
        report = ReportDir.create(args.report_dir, bench.command)  # only now: nothing half-written
        for log in Path(logs).glob("*.log"):
            shutil.copy(log, report.path / log.name)
    print("\n".join(bench.text(result)))
    warn(bench.warnings(result))
    bench.write_report(result, report)
    print(f"report: {report.path}")
    if args.json:
        print(bench.json_line(result))
    return 0


# `dpscale bench NAME`s whose shape differs from `run_bench`'s: (help, flags, runner)
_OWN_RUNNERS = {
    "convergence": (convergence_report.BENCH.help, add_convergence_arguments, run_convergence),
    "engine": (
        "step time of dpscale vs torch DDP vs no synchronization, alternating",
        add_engine_arguments,
        run_engine,
    ),
}


def register(sub) -> None:
    """`dpscale bench ...`: every bench of benches.py whose command is `bench NAME`, in its order."""
    commands: dict[str, tuple] = {}
    for b in BENCHES:
        if b.argv[0] == "bench" and b.argv[1] not in commands:
            commands[b.argv[1]] = _OWN_RUNNERS.get(b.argv[1]) or (
                b.help,
                functools.partial(add_bench_arguments, b),
                functools.partial(run_bench, b),
            )
    commands |= {name: runner for name, runner in _OWN_RUNNERS.items() if name not in commands}
    group = sub.add_parser("bench", help="measure: all-reduce, scaling, convergence, engines side by side")
    bsub = group.add_subparsers(dest="bench", required=True, metavar="{" + ",".join(commands) + "}")
    for name, (text, add_arguments, run) in commands.items():
        p = bsub.add_parser(name, help=text, description=text)
        add_arguments(p)
        p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    """Run `bench engine` outside the `dpscale` CLI (benchmarks/engine.py)."""
    parser = argparse.ArgumentParser(description="step time of dpscale vs torch DDP vs no synchronization")
    add_engine_arguments(parser)
    return run_engine(parser.parse_args(argv))
