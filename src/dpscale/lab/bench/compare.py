"""`dpscale report DIR DIR [DIR...]`: compare bench reports (one DIR is re-rendered: rerender.py).

Two or more directories: an A/B table of each bench's headline figures. The first directory is the baseline A;
every ratio is (that report's value) / (A's value). A comparison reads report.json as plain JSON, so
it needs no bench module and works on reports from other machines and older versions.

Rows are matched on key columns, per command (each bench's `compare`, benches.py); reports of
different setups are compared with a warning each, or refused when they share no model.

A comparison prints the table and writes compare-<UTC>/ under the first directory's parent (or
--out DIR) with report.md, compare.csv (the table) and compare.json (`Comparison.to_dict()`):
    {"command": str, "baseline": "A",
     "reports": [{"label": str, "dir": str, "command_line": str | null, "created_utc": str | null,
                  "system": {...} | null (sysinfo's layout)}, ...],
     "key_columns": [str], "metrics": [str], "warnings": [str],
     "rows": [{"key": {column: value}, "values": {metric: [value or null, one per report]},
               "ratios": {metric: [value / A's or null, one per report after A]}}, ...]}
"""

from __future__ import annotations

import csv
import json
import string
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dpscale.errors import ConfigError
from dpscale.lab.bench.bench import Figures, check_setups
from dpscale.lab.bench.benches import FIGURES
from dpscale.lab.bench.report import load_untrusted_json, markdown_table, text_table
from dpscale.lab.bench.sysinfo import describe_system
from dpscale.paths import check_writable_dir, open_no_follow, write_no_follow

# Which way is better, for the note under the table; every other metric: higher is better.
LOWER_IS_BETTER = ("time_us", "final_loss", "step_ms")


# ---- reading -------------------------------------------------------------------


def load_report(directory: str | Path) -> dict:
    """report.json of a report directory; ValueError naming the directory when it is not one."""
    path = Path(directory) / "report.json"
    if not path.is_file():
        raise ConfigError(
            f"{directory}: no report.json there; give a report directory (written by dpscale bench, "
            "study, predict or scale)"
        )
    doc = load_untrusted_json(path, where=str(path))
    missing = [k for k in ("command", "results") if not (isinstance(doc, dict) and k in doc)]
    if missing:
        raise ConfigError(f"{path}: not a bench report, it lacks {', '.join(missing)}")
    if not isinstance(doc["command"], str):
        raise ConfigError(f"{path}: command is {type(doc['command']).__name__}, not a command's name")
    if doc["command"].startswith("scaling-"):  # an older study's scaling part, named after its folder
        doc["command"] = "scaling"
    return doc


# ---- comparing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Comparison:
    command: str
    reports: list[dict]  # label, dir, command_line, created_utc, system
    key_columns: list[str]
    metrics: list[str]
    rows: list[dict]  # {"key": {...}, "values": {metric: [...]}, "ratios": {metric: [...]}}
    warnings: list[str] = field(default_factory=list)  # how the reports' setups differ, one line each

    @property
    def labels(self) -> list[str]:
        return [r["label"] for r in self.reports]

    def to_dict(self) -> dict:
        return {"command": self.command, "baseline": self.labels[0], **asdict(self)}

    def flat_rows(self) -> list[dict]:
        """One dict per row: the key columns, then per metric each report's value and each ratio to A."""
        base, others = self.labels[0], self.labels[1:]
        flat = []
        for row in self.rows:
            cells = dict(row["key"])
            for m in self.metrics:
                cells |= {f"{m} {label}": v for label, v in zip(self.labels, row["values"][m], strict=True)}
                cells |= {f"{m} {label}/{base}": v for label, v in zip(others, row["ratios"][m], strict=True)}
            flat.append(cells)
        return flat

    @property
    def columns(self) -> list[str]:
        base, others = self.labels[0], self.labels[1:]
        value_columns = [
            c
            for m in self.metrics
            for c in [f"{m} {x}" for x in self.labels] + [f"{m} {x}/{base}" for x in others]
        ]
        return [*self.key_columns, *value_columns]


def _label(index: int) -> str:
    return string.ascii_uppercase[index] if index < 26 else f"R{index + 1}"


def _key_columns(figures: Figures, row_sets: Sequence[list[dict]]) -> list[str]:
    """The documented key, plus those extra columns that tell apart rows of one report sharing a key.

    Only as needed: a column that differs between reports but not within one (dpscale's transport
    in an shm-vs-gloo A/B) must not split the rows that the comparison is about."""

    def distinct(columns: list[str], rows: list[dict]) -> int:
        return len({tuple(r.get(c) for c in columns) for r in rows})

    columns = list(figures.key_columns)
    for extra in figures.extra_key_columns:
        if all(distinct(columns, rows) == len(rows) for rows in row_sets):
            break
        if any(distinct([*columns, extra], rows) > distinct(columns, rows) for rows in row_sets):
            columns.append(extra)
    return columns


def _ratio(value: object, base: object) -> float | None:
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (value, base)):
        return None
    assert isinstance(value, int | float) and isinstance(base, int | float)
    return value / base if base != 0 else None


def compare(directories: Sequence[str | Path]) -> Comparison:
    """Match the reports' rows on their key columns and put each metric side by side with its ratio to A."""
    if len(directories) < 2:
        raise ConfigError("dirs: a comparison needs two or more report directories")
    docs = [load_report(d) for d in directories]
    command = docs[0]["command"]
    for d, doc in zip(directories[1:], docs[1:], strict=True):
        if doc["command"] != command:
            raise ConfigError(
                f"cannot compare a {command} report ({directories[0]}) with a {doc['command']} report "
                f"({d}); compare reports of the same command"
            )
    if command not in FIGURES:
        raise ConfigError(
            f"{directories[0]}: {command} reports cannot be compared; known: {', '.join(FIGURES)}"
        )
    figures = FIGURES[command]
    labels = [_label(i) for i in range(len(docs))]
    warnings = check_setups(figures, labels, directories, docs)
    row_sets = []
    for d, doc in zip(directories, docs, strict=True):
        try:
            row_sets.append(list(figures.rows(doc["results"])))
        except (KeyError, TypeError) as e:
            raise ConfigError(f"{d}: its report.json results are not a {command} result ({e!r})") from None
    key_columns = _key_columns(figures, row_sets)
    by_key: list[dict[tuple, dict]] = [
        {tuple(r.get(c) for c in key_columns): r for r in rows} for rows in row_sets
    ]
    keys = list(dict.fromkeys(k for rows in by_key for k in rows))  # first seen first, A's order leading
    rows = []
    for key in keys:
        values = {m: [rows.get(key, {}).get(m) for rows in by_key] for m in figures.metrics}
        ratios = {m: [_ratio(v, values[m][0]) for v in values[m][1:]] for m in figures.metrics}
        rows.append({"key": dict(zip(key_columns, key, strict=True)), "values": values, "ratios": ratios})
    reports = [
        {
            "label": _label(i),
            "dir": str(d),
            "command_line": doc.get("command_line"),
            "created_utc": doc.get("created_utc"),
            "system": doc.get("system"),
        }
        for i, (d, doc) in enumerate(zip(directories, docs, strict=True))
    ]
    return Comparison(command, reports, key_columns, list(figures.metrics), rows, warnings)


# ---- rendering ----------------------------------------------------------------------------------


def _cell(column: str, value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if "/" in column:
            return f"{value:.3f}"  # ratios: fixed, to line up
        # 4 significant digits, but never 1.121e+04 beside 774.7: large values as whole numbers
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


def format_comparison(comparison: Comparison) -> str:
    """The comparison as a fixed-width terminal table, preceded by which report is which."""
    lines = [f"{r['label']}: {r['dir']}" for r in comparison.reports]
    lines += [f"warning: {w}" for w in comparison.warnings]
    formats = {c: (lambda v, c=c: _cell(c, v)) for c in comparison.columns}
    return "\n".join([*lines, text_table(comparison.flat_rows(), comparison.columns, formats)])


def _note(comparison: Comparison) -> str:
    lower = [m for m in comparison.metrics if m in LOWER_IS_BETTER]
    higher = [m for m in comparison.metrics if m not in LOWER_IS_BETTER]
    parts = [f"{', '.join(lower)}: lower is better"] if lower else []
    parts += [f"{', '.join(higher)}: higher is better"] if higher else []
    base = comparison.labels[0]
    matched = f"Rows are matched on {', '.join(comparison.key_columns)}"
    ratio = (
        f"a ratio X/{base} is X's value divided by {base}'s (\"-\": missing in a report, or a zero baseline)"
    )
    return "; ".join([matched, ratio, *parts]) + "."


@dataclass(frozen=True, kw_only=True)
class ReportConfig:
    """`dpscale report DIR [DIR...]`: one directory is re-rendered (rerender.py), two or more compared."""

    dirs: tuple[str, ...]
    """The report directories; the first is the baseline A of a comparison."""
    out: str | None = None
    """where a comparison goes (default: compare-<UTC> next to the first DIR)"""

    def __post_init__(self) -> None:
        if not self.dirs:
            raise ConfigError("dirs: give one report directory to re-render, or two or more to compare")
        if self.out is not None and len(self.dirs) == 1:
            raise ConfigError("--out: only a comparison (two or more DIRs) writes a new directory")


def output_dir(first: str | Path, out: str | Path | None) -> Path:
    if out is not None:
        check_writable_dir("--out", out)
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        return path
    base = Path(first).resolve().parent
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for n in range(1, 1000):  # two comparisons in one second get -2, -3, ... (mkdir is the claim)
        path = base / (f"compare-{stamp}" if n == 1 else f"compare-{stamp}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise RuntimeError(f"could not find a free comparison directory name under {base} for {stamp}")


def write_comparison(comparison: Comparison, directory: Path) -> Path:
    """Write report.md, compare.json and compare.csv into `directory`; returns report.md's path."""
    write_no_follow(
        directory / "compare.json", json.dumps(comparison.to_dict(), indent=2, allow_nan=False) + "\n"
    )
    with open_no_follow(directory / "compare.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=comparison.columns)
        writer.writeheader()
        writer.writerows(comparison.flat_rows())
    lines = [f"# {comparison.command} reports compared", "", "## Reports", ""]
    for report in comparison.reports:
        lines += [f"### {report['label']}: `{report['dir']}`", ""]
        if report["system"]:
            lines += describe_system(report["system"])
        lines += [f"- **Command:** `{report['command_line'] or 'unknown'}`", ""]
    if comparison.warnings:
        lines += ["## Warnings", "", *(f"- {w}" for w in comparison.warnings), ""]
    formats = {c: (lambda v, c=c: _cell(c, v)) for c in comparison.columns}
    lines += ["## Results", "", _note(comparison), ""]
    lines += [markdown_table(comparison.flat_rows(), comparison.columns, formats), ""]
    path = directory / "report.md"
    write_no_follow(path, "\n".join(lines))
    return path
