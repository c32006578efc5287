"""`dpscale study` (all the benches, one report) and `dpscale report` (re-render or compare reports)."""

from __future__ import annotations

import argparse
import json

from dpscale.cli.bench import add_config_flag, warn
from dpscale.errors import ConfigError
from dpscale.flags import add_dataclass_arguments, config_kwargs, dataclass_kwargs
from dpscale.lab.bench import compare, rerender, study
from dpscale.lab.bench.report import ReportDir, require_plots
from dpscale.paths import check_writable_dir


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
    try:
        comparison = compare.compare(config.dirs)
    except (KeyError, TypeError, AttributeError, IndexError, OverflowError) as e:
        # the reports were read (compare.load_report checks what it can); a value of the wrong
        # type under a known key is still input, not a bug of dpscale's
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        raise ConfigError(f"a report.json holds a value of the wrong type ({reason})") from None
    print(compare.format_comparison(comparison))
    path = compare.write_comparison(comparison, compare.output_dir(config.dirs[0], config.out))
    print(f"report: {path.parent}")
    return 0
