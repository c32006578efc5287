"""The benches, and every kind of report dpscale writes: the one list the CLI registers commands
from, `dpscale report` re-renders and compares through, and the study writes its parts with.

A new bench is one module ending in `BENCH = Bench(...)` (bench.py) and one line in `BENCHES`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dpscale.lab.bench import (
    allreduce_report,
    convergence_report,
    scaling_report,
    script_scaling_report,
    study,
    weak_report,
)
from dpscale.lab.bench.bench import Bench, Figures
from dpscale.lab.bench.report import ReportDir
from dpscale.lab.predict import render as predict_render

BENCHES: tuple[Bench, ...] = (
    allreduce_report.BENCH,
    scaling_report.BENCH,
    convergence_report.BENCH,
    weak_report.BENCH,  # `bench convergence --mode weak`
    script_scaling_report.BENCH,  # `dpscale scale`
)
BY_COMMAND: dict[str, Bench] = {b.command: b for b in BENCHES}

# report command -> (results JSON -> result object, renderer of that object into a ReportDir):
# every bench's, and the reports made of them (study) or outside the benches (predict)
RENDERERS: dict[str, tuple[Callable[[dict], Any], Callable[[Any, ReportDir], None]]] = {
    **{b.command: (b.from_dict, b.write_report) for b in BENCHES},
    "study": (study.StudyResult.from_dict, study.write_report),
    "predict": (
        predict_render.results_from_doc,
        lambda results, report: predict_render.write_report(report, *results),
    ),
}
# report command -> what `dpscale report A B ...` compares in its reports
FIGURES: dict[str, Figures] = {
    **{b.command: b.compare for b in BENCHES},
    "study": study.FIGURES,
    "predict": predict_render.FIGURES,
}
