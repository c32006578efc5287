"""`dpscale report DIR`: write a report's report.md, plots and CSV again from its report.json.

After a change to the rendering, or to restore deleted files. `RENDERERS` (benches.py) says which
function reads a command's results and which renders them; it covers every report dpscale writes:
the benches' (`bench engine` writes a scaling report), `scale`, `predict` and `study`, whose parts
are re-rendered with it (and each on its own).

The report keeps the command line it was made with. Reports written before the parts of a study
recorded runnable commands (`'(part of dpscale study)'`, a command named after the folder, such as
`scaling-mlp`) get them rebuilt from their config.
"""

from __future__ import annotations

from pathlib import Path

from dpscale.errors import ConfigError
from dpscale.lab.bench import study
from dpscale.lab.bench.benches import RENDERERS
from dpscale.lab.bench.compare import load_report
from dpscale.lab.bench.report import ReportDir

_OLD_PART_ARGUMENT = "(part of dpscale study)"


def rerender(directory: str | Path) -> Path:
    """Write `directory`'s report.md, plots and CSV again from its report.json; returns report.md's path."""
    doc = load_report(directory)
    command = doc["command"]  # load_report names an older study's scaling part "scaling"
    if command not in RENDERERS:
        raise ConfigError(
            f"{directory}: report command {doc['command']!r} cannot be re-rendered; "
            f"known: {', '.join(RENDERERS)}"
        )
    from_dict, write_report = RENDERERS[command]
    try:
        result = from_dict(doc["results"])
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        # a report.json edited by hand, or written by another version of dpscale
        reason = f"{type(e).__name__}: {e}".splitlines()[0]
        raise ConfigError(
            f"{directory}: its report.json results are not a {command} result ({reason}); was it "
            "edited, or written by another version of dpscale?"
        ) from None
    if not isinstance(doc.get("system"), dict) or not isinstance(doc.get("argv") or [], list):
        raise ConfigError(f"{directory}: its report.json lacks the system it was measured on")
    # The original command line and system, not this process's: the report describes that run.
    argv = list(doc.get("argv") or [])
    if _OLD_PART_ARGUMENT in argv:
        argv = study.part_argv(command, result.config)
    report = ReportDir(path=Path(directory), command=command, argv=argv, system=doc["system"])
    try:
        write_report(result, report)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as e:
        if isinstance(e, ConfigError):
            raise
        # a value of the wrong type that from_dict let through, met while rendering
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        raise ConfigError(
            f"{directory}: its report.json holds a value report.md cannot show ({reason})"
        ) from None
    return report.path / "report.md"
