"""What a lab command is: its entry in `dpscale --help`, the flags it has besides its config's, and
the one shape every bench runs in (`Bench`): config from the flags, measure, print, warn, write the
report, and the --json line last.

commands.py lists the commands; this module knows no bench, so a new bench command is one
`Bench(...)` there. Three commands keep runners of their own because their shape differs:
`bench engine` writes one report per model as it goes, `study` writes its combined report under
its config's directory before printing the summary, and `scale` keeps its script's logs in the
report and tells the script's own failure (exit 1) from bad input.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dpscale.flags import config_file_kwargs, dataclass_kwargs
from dpscale.lab.bench.report import ReportDir, require_plots
from dpscale.paths import check_writable_dir

if TYPE_CHECKING:
    from dpscale.lab.bench.kinds import ReportKind


@dataclass(frozen=True)
class Command:
    """One subcommand: `dpscale <group> <name>` (group None: `dpscale <name>`)."""

    group: str | None
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def add_output_flags(parser: argparse.ArgumentParser, json_help: str, report_help: str = "report") -> None:
    """The flags every bench has besides its config's: the config file, where the report goes,
    JSON on stdout."""
    add_config_flag(parser)
    parser.add_argument("--json", action="store_true", help=json_help)
    parser.add_argument(
        "--report-dir", default="reports", help=f"base directory of the {report_help} (default reports)"
    )


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE.toml",
        default=None,
        help="set any of the fields below from a TOML file (keys as the flags, without --); flags override",
    )


def config_kwargs(args: argparse.Namespace, cls: type) -> dict:
    """The config's fields from --config FILE.toml, then from the flags given (a flag wins)."""
    path = getattr(args, "config", None)
    return (config_file_kwargs(path, cls) if path else {}) | dataclass_kwargs(args, cls)


def warn(warnings: list[str]) -> None:
    """The trust checks' lines (bench/trust.py), on stderr so a --json line stays last on stdout."""
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Bench:
    """A bench command's run: what differs between benches is data; the order of what the user
    sees (results, warnings, where the report is, then the --json line) is the same for all."""

    name: str  # the command as the user typed it, for require_plots' message
    kind: ReportKind  # the report it writes (kinds.py)
    config: Callable[[argparse.Namespace], Any]  # the flags (and --config) -> the bench's config
    # config -> result: a lambda calling the measurement module's `run`, looked up at each call so
    # that a test can replace it
    measure: Callable[[Any], Any]
    text: Callable[[Any], list[str]]  # result -> the terminal lines, before the warnings
    json_line: Callable[[Any], str]  # result -> what --json prints last
    warnings: Callable[[Any], list[str]] = lambda result: []
    exit_code: Callable[[Any], int] = lambda result: 0

    def __call__(self, args: argparse.Namespace) -> int:
        require_plots(self.name)
        check_writable_dir("--report-dir", args.report_dir)  # before measuring, not after
        result = self.measure(self.config(args))
        print("\n".join(self.text(result)))
        warn(self.warnings(result))
        report = ReportDir.create(args.report_dir, self.kind.command)
        self.kind.write_report(result, report)
        print(f"report: {report.path}")
        if args.json:
            print(self.json_line(result))
        return self.exit_code(result)
