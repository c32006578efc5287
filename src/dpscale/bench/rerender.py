"""`dpscale report DIR`: write a bench report's report.md, plots and CSV again from its report.json.

After a change to the rendering, or to restore deleted files. `RENDERERS` is the explicit table of
which result class reads a command's results and which function renders them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..errors import ConfigError
from . import (
    allreduce,
    allreduce_report,
    convergence,
    convergence_report,
    scaling,
    scaling_report,
    script_scaling,
    script_scaling_report,
)
from .compare import load_report
from .report import ReportDir

# command -> (results JSON -> result object, renderer of that object into a ReportDir)
RENDERERS: dict[str, tuple[Callable[[dict], object], Callable[[object, ReportDir], None]]] = {
    "allreduce": (allreduce.AllReduceResult.from_dict, allreduce_report.write_report),
    "scaling": (scaling.ScalingResult.from_dict, scaling_report.write_report),
    "convergence": (convergence.ConvergenceResult.from_dict, convergence_report.write_report),
    "scale": (script_scaling.ScaleResult.from_dict, script_scaling_report.write_report),
}


def rerender(directory: str | Path) -> Path:
    """Write `directory`'s report.md, plots and CSV again from its report.json; returns report.md's path."""
    doc = load_report(directory)
    if doc["command"] not in RENDERERS:
        raise ConfigError(
            f"{directory}: report command {doc['command']!r} cannot be re-rendered; "
            f"known: {', '.join(RENDERERS)}"
        )
    from_dict, write_report = RENDERERS[doc["command"]]
    result = from_dict(doc["results"])
    # The original command line and system, not this process's: the report describes that run.
    report = ReportDir(
        path=Path(directory), command=doc["command"], argv=list(doc.get("argv") or []), system=doc["system"]
    )
    write_report(result, report)
    return report.path / "report.md"
