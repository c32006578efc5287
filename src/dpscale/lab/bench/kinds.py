"""The kinds of report a bench writes, one entry each: how report.json's results become a result
object again, how that is rendered into a report directory, and the command line that writes it.

`dpscale report DIR` re-renders any kind through this table (rerender.py adds the study and
predict reports on top), the study writes its parts through it, and each bench command names its
kind here. A new bench is one `ReportKind` here; comparing its reports is one entry in
comparable.py (which reads plain JSON and needs no bench module).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dpscale.flags import config_argv
from dpscale.lab.bench import (
    allreduce,
    allreduce_report,
    convergence,
    convergence_report,
    scaling,
    scaling_report,
    script_scaling,
    script_scaling_report,
    weak,
    weak_report,
)
from dpscale.lab.bench.report import ReportDir


@dataclass(frozen=True)
class ReportKind:
    command: str  # report.json's "command" and the report directory's prefix
    argv: tuple[str, ...]  # the dpscale command that writes it, before its config's flags
    from_dict: Callable[[dict], Any]  # report.json's "results" -> the bench's Result
    write_report: Callable[[Any, ReportDir], None]

    def command_line(self, config: object) -> list[str]:
        """The command that runs this bench with `config` on its own, exactly (defaults written)."""
        return ["dpscale", *self.argv, *config_argv(config)]


ALLREDUCE = ReportKind(
    "allreduce", ("bench", "allreduce"), allreduce.AllReduceResult.from_dict, allreduce_report.write_report
)
SCALING = ReportKind(
    "scaling", ("bench", "scaling"), scaling.ScalingResult.from_dict, scaling_report.write_report
)
CONVERGENCE = ReportKind(
    "convergence",
    ("bench", "convergence"),
    convergence.ConvergenceResult.from_dict,
    convergence_report.write_report,
)
WEAK = ReportKind(  # a mode of `bench convergence`, with a report of its own
    "convergence-weak",
    ("bench", "convergence", "--mode", "weak"),
    weak.WeakResult.from_dict,
    weak_report.write_report,
)
SCALE = ReportKind(  # no study part: its reports keep the user's own command line
    "scale", ("scale",), script_scaling.ScaleResult.from_dict, script_scaling_report.write_report
)
KINDS: dict[str, ReportKind] = {k.command: k for k in (ALLREDUCE, SCALING, CONVERGENCE, WEAK, SCALE)}
