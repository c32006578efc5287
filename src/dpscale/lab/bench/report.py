"""Write one bench run's report directory: report.json, CSV tables, PNG plots and report.md.

Every bench renders through this writer, so all reports share one layout:

    reports/20261129T183012Z-allreduce/
        report.json   {"command", "argv", "command_line", "config", "system", "results", "created_utc"}
        *.csv         one row per measured point
        *.png         plots (matplotlib, Agg: no display needed)
        report.md     system, exact command line, then the bench's tables and plots

`results` in report.json is the bench's own documented JSON (its result dataclass's `to_dict()`);
the markdown and the plots are rendered from the same data, so an old run can be re-rendered or
compared from its report.json alone.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import re
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpscale.errors import ConfigError, import_extra
from dpscale.lab.bench.args import format_size
from dpscale.lab.bench.sysinfo import collect_system_info, describe_system
from dpscale.paths import open_no_follow, write_no_follow

if TYPE_CHECKING:  # matplotlib is the lab extra's: imported when a plot is drawn, not before
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# A column format is a format spec (".2f") or a function of the cell's value.
CellFormat = str | Callable[[Any], str]
# The text of a missing (None) cell, from its row and column: "-" (not applicable) by default; a
# table can tell "not applicable" from "not measured" with it.
MissingText = Callable[[Mapping[str, object], str], str]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# Enough for sharp lines when the PNG is shown at its natural size in a markdown viewer.
_DPI = 120


@dataclass(frozen=True)
class Table:
    """A markdown table rendered from rows of dicts (see `markdown_table`)."""

    rows: Sequence[Mapping[str, object]]
    columns: Sequence[str]
    formats: Mapping[str, CellFormat] | None = None
    headers: Mapping[str, str] | None = None
    missing: MissingText | None = None


@dataclass(frozen=True)
class Image:
    """A PNG already saved in the report directory, embedded as `![alt](file)`."""

    file: str
    alt: str


@dataclass(frozen=True)
class Section:
    """A `## heading` followed by blocks: markdown text (str), a Table or an Image, in order."""

    heading: str
    blocks: Sequence[str | Table | Image]


def _cells(table: Table) -> tuple[list[str], list[list[str]], list[bool]]:
    """The header texts, each row's cell texts and which columns are numeric (right-aligned)."""
    formats, headers = table.formats or {}, table.headers or {}
    unknown = [c for c in (*formats, *headers) if c not in table.columns]
    if unknown:
        raise ConfigError(
            f"formats/headers name columns {unknown} that are not in columns {list(table.columns)}"
        )

    def cell(row: Mapping[str, object], column: str) -> str:
        value = row.get(column)
        if value is None:
            return table.missing(row, column) if table.missing else "-"
        fmt = formats.get(column)
        return fmt(value) if callable(fmt) else format(value, fmt or "")

    def numeric(column: str) -> bool:
        values = [r.get(column) for r in table.rows if r.get(column) is not None]
        return bool(values) and all(isinstance(v, int | float) for v in values)

    return (
        [headers.get(c, c) for c in table.columns],
        [[cell(r, c) for c in table.columns] for r in table.rows],
        [numeric(c) for c in table.columns],
    )


def markdown_table(
    rows: Sequence[Mapping[str, object]],
    columns: Sequence[str],
    formats: Mapping[str, CellFormat] | None = None,
    headers: Mapping[str, str] | None = None,
    missing: MissingText | None = None,
) -> str:
    """Render rows as a GitHub markdown table (for report.md); numeric columns are right-aligned.

    `formats` maps a column to a format spec (".3g") or a function; missing values show as "-",
    or as `missing(row, column)` says. `headers` maps a column to its header text (default: the
    column name).
    """
    head, body, numeric = _cells(Table(rows, columns, formats, headers, missing))
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---:" if n else ":---" for n in numeric) + "|",
    ]
    lines += ["| " + " | ".join(text.replace("|", "\\|") for text in row) + " |" for row in body]
    return "\n".join(lines)


def text_table(
    rows: Sequence[Mapping[str, object]],
    columns: Sequence[str],
    formats: Mapping[str, CellFormat] | None = None,
    headers: Mapping[str, str] | None = None,
    missing: MissingText | None = None,
    *,
    styled: bool | None = None,
) -> str:
    """The same table as `markdown_table`, for the terminal (the one renderer of both).

    `styled`: drawn by rich, with rules and a bold header, as on a terminal; else plain columns
    two spaces apart, as in a log or a pipe. None: styled when stdout is a terminal and rich (the
    lab extra) is installed."""
    head, body, numeric = _cells(Table(rows, columns, formats, headers, missing))
    if styled is None:
        styled = sys.stdout.isatty() and importlib.util.find_spec("rich") is not None
    if styled:
        return _rich_table(head, body, numeric)
    widths = [max([len(h), *(len(row[i]) for row in body)]) for i, h in enumerate(head)]

    def line(texts: list[str]) -> str:
        cells = (t.rjust(w) if n else t.ljust(w) for t, w, n in zip(texts, widths, numeric, strict=True))
        return "  ".join(cells).rstrip()

    return "\n".join([line(head), *(line(row) for row in body)])


def _rich_table(head: list[str], body: list[list[str]], numeric: list[bool]) -> str:
    console_mod = import_extra("rich.console", "a styled table")
    table_mod = import_extra("rich.table", "a styled table")
    table = table_mod.Table(box=import_extra("rich.box", "a styled table").SIMPLE_HEAD, header_style="bold")
    for h, n in zip(head, numeric, strict=True):
        table.add_column(h, justify="right" if n else "left", no_wrap=True)
    for row in body:
        table.add_row(*row)
    # as wide as the table needs: a wide summary scrolls rather than wraps its cells
    console = console_mod.Console(file=io.StringIO(), width=10_000, force_terminal=True, soft_wrap=True)
    console.print(table)
    return "\n".join(line.rstrip() for line in console.file.getvalue().rstrip("\n").splitlines())


def size_axis(ax: Axes, sizes_bytes: Sequence[int]) -> None:
    """Make `ax`'s x axis a log2 byte-size axis labelled 4B, 1K, 64M at the measured sizes."""
    ax.set_xscale("log", base=2)
    ticks = sorted(set(sizes_bytes))
    while len(ticks) > 14:  # thin the labels of long sweeps so they do not overlap
        ticks = ticks[::2]
    ax.set_xticks(ticks, [format_size(s) for s in ticks])
    ax.xaxis.set_minor_locator(import_extra("matplotlib.ticker", "drawing a plot").NullLocator())
    ax.set_xlabel("message size (bytes, binary units)")
    ax.grid(True, which="major", alpha=0.35)


def require_plots(command: str) -> None:
    """Refuse a command that ends in a report, before it measures, when matplotlib is missing."""
    import_extra("matplotlib", f"dpscale {command} (its report's plots)")


def new_figure(width_in: float = 8.0, height_in: float = 4.5) -> Figure:
    """A figure on the Agg canvas, made without pyplot: no display, no global figure registry."""
    figure = import_extra("matplotlib.figure", "drawing a report's plots")
    agg = import_extra("matplotlib.backends.backend_agg", "drawing a report's plots")
    fig = figure.Figure(figsize=(width_in, height_in), layout="constrained")
    agg.FigureCanvasAgg(fig)
    return fig


@dataclass(frozen=True)
class ReportDir:
    """One bench run's output directory; build it with `ReportDir.create`."""

    path: Path
    command: str
    argv: list[str]
    system: dict
    # said at the head of report.md besides the bench's own warnings (a --quick study's parts)
    notes: tuple[str, ...] = ()

    @classmethod
    def create(
        cls, base: str | Path = "reports", command: str = "allreduce", *, argv: Sequence[str] | None = None
    ) -> ReportDir:
        """Make `<base>/<UTC time like 20261129T183012Z>-<command>/`, never reusing a directory.

        `argv` is the command line to record (default: this process's, with the program shown by
        its name only, e.g. `dpscale bench allreduce --sizes 4K`).
        """
        if not _NAME_RE.match(command):
            raise ConfigError(f"command {command!r} cannot name a directory; use letters, digits, _ . -")
        if argv is None:
            argv = [*_program(sys.argv[0]), *sys.argv[1:]]
        base = Path(base)
        base.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        # Two runs in the same second (a script, a test) get -2, -3, ...; mkdir without exist_ok
        # is the atomic claim, so concurrent creators cannot both take one name.
        for n in range(1, 1000):
            path = base / (f"{stamp}-{command}" if n == 1 else f"{stamp}-{command}-{n}")
            try:
                path.mkdir()
            except FileExistsError:
                continue
            return cls(path=path, command=command, argv=list(argv), system=collect_system_info())
        raise RuntimeError(f"could not find a free report directory name under {base} for {stamp}")

    @property
    def command_line(self) -> str:
        return shlex.join(self.argv)

    def _file(self, name: str, suffix: str) -> Path:
        if not _NAME_RE.match(name):
            raise ConfigError(f"file name {name!r} must be a plain name (letters, digits, _ . -)")
        return self.path / (name if name.endswith(suffix) else name + suffix)

    def write_json(self, results: object, *, config: Mapping | None = None) -> Path:
        """Write report.json; `results` is the bench's documented JSON (e.g. `result.to_dict()`)."""
        doc = {
            "command": self.command,
            "argv": self.argv,
            "command_line": self.command_line,
            "config": dict(config) if config is not None else None,
            "system": self.system,
            "results": results,
            "created_utc": self.system["timestamp_utc"],
        }
        path = self.path / "report.json"
        # allow_nan=False: NaN/Infinity are not JSON; a bench that produces them has a bug to fix
        # here rather than a file other tools cannot read.
        write_no_follow(path, json.dumps(doc, indent=2, allow_nan=False) + "\n")
        return path

    def write_csv(self, name: str, rows: Sequence[Mapping[str, object]]) -> Path:
        """Write rows as `<name>.csv`; the header is the union of the rows' keys in first-seen order."""
        columns: dict[str, None] = {}
        for row in rows:
            columns.update(dict.fromkeys(row))
        path = self._file(name, ".csv")
        with open_no_follow(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(columns))
            writer.writeheader()
            writer.writerows(rows)
        return path

    def save_figure(self, fig: Figure, name: str) -> Path:
        """Save `fig` as `<name>.png` (use `new_figure()` to make one without pyplot)."""
        path = self._file(name, ".png")
        with open_no_follow(path, "wb") as f:
            fig.savefig(f, dpi=_DPI, format="png")
        return path

    def write_markdown(
        self, title: str, sections: Sequence[Section], *, warnings: Sequence[str] = ()
    ) -> Path:
        """Write report.md: system, the exact command line, the warnings (bench/trust.py), then
        `sections` in order."""
        lines = [f"# {title}", "", "## System", "", *describe_system(self.system), ""]
        lines += ["## Command", "", "```", self.command_line, "```", ""]
        warnings = [*self.notes, *warnings]
        if warnings:
            lines += ["## Warnings", "", *(f"- **Warning:** {w}" for w in warnings), ""]
        for section in sections:
            lines += [f"## {section.heading}", ""]
            for block in section.blocks:
                lines += [self._render_block(block), ""]
        path = self.path / "report.md"
        write_no_follow(path, "\n".join(lines))
        return path

    def _render_block(self, block: str | Table | Image) -> str:
        if isinstance(block, Table):
            return markdown_table(block.rows, block.columns, block.formats, block.headers, block.missing)
        if isinstance(block, Image):
            # A broken image link in a report is easy to miss; refuse it while it is easy to fix.
            if not (self.path / block.file).is_file():
                raise ConfigError(f"image {block.file!r} is not in {self.path}; save_figure it first")
            return f"![{block.alt}]({block.file})"
        if isinstance(block, str):
            return block.rstrip()
        raise TypeError(f"a section block must be str, Table or Image, not {type(block).__name__}")


def _program(argv0: str) -> list[str]:
    """How to start this program again: `dpscale` for the CLI however it was started (the console
    script, `python -m dpscale.cli.main`), `python SCRIPT` for a script such as benchmarks/engine.py."""
    path = Path(argv0)
    if path.name == "dpscale" or path.parent.name == "dpscale":
        return ["dpscale"]
    return ["python", argv0] if path.suffix == ".py" else [path.name]


def read_report(location: str | Path, *, flag: str) -> dict:
    """The report.json document of a report directory (or of the file itself).

    ValueError, prefixed with `flag` (the option that named it), when it cannot be read or holds
    no bench results.
    """
    path = Path(location)
    path = path / "report.json" if path.is_dir() else path
    doc = load_untrusted_json(path, where=f"{flag}: {path}")
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), dict | list):
        raise ConfigError(f"{flag}: {path} is not a dpscale report (it has no results)")
    return doc


# what a report.json may hold: it is read back from disk (re-rendered, compared, calibrated from),
# where anyone may have edited it; dpscale never writes deeper nesting or larger numbers
MAX_JSON_DEPTH = 32
MAX_JSON_NUMBER = 1e18
# characters that would act in report.md (HTML, autolinks, markdown links and images, table cells)
# become entities; control characters (ANSI escapes among them, which act on a terminal) are
# dropped. Backticks stay: dpscale's own texts quote commands with them, and a code span runs nothing
_ACTIVE = {"&": "&amp;", "<": "&lt;", ">": "&gt;", "|": "&#124;", "[": "&#91;", "]": "&#93;"}
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def load_untrusted_json(path: Path, *, where: str) -> Any:
    """A JSON document from a file anyone may have edited, made safe to render: every string with
    `_ACTIVE` characters as entities and control characters dropped. A ConfigError (one line,
    `where` first, naming the key) for a file that is not UTF-8 JSON, nests deeper than
    MAX_JSON_DEPTH, or holds NaN, Infinity or a number beyond MAX_JSON_NUMBER."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it ({e.strerror})") from None
    try:
        doc = json.loads(text, parse_constant=float)  # NaN and Infinity are refused below, by key
    except RecursionError:
        raise ConfigError(f"{where}: not a report (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError, or an integer of thousands of digits
        raise ConfigError(f"{where}: cannot read it as JSON ({' '.join(str(e).split())[:160]})") from None
    return _safe(doc, "", 0, where)


def _safe(value: Any, key: str, depth: int, where: str) -> Any:
    if depth > MAX_JSON_DEPTH:
        raise ConfigError(
            f"{where}: {_CONTROL.sub('', key) or 'the document'} nests more than {MAX_JSON_DEPTH} levels deep"
        )
    if isinstance(value, str):
        return safe_text(value)
    if isinstance(value, dict):
        return {
            safe_text(k): _safe(v, f"{key}.{k}" if key else k, depth + 1, where) for k, v in value.items()
        }
    if isinstance(value, list):
        return [_safe(v, f"{key}[{i}]", depth + 1, where) for i, v in enumerate(value)]
    if isinstance(value, bool) or value is None:
        return value
    if not abs(value) <= MAX_JSON_NUMBER:  # NaN fails this too
        shown = f"{value:.3g}" if isinstance(value, float) else f"an integer of {len(str(abs(value)))} digits"
        raise ConfigError(
            f"{where}: {_CONTROL.sub('', key)} is {shown}, not a finite number within +-{MAX_JSON_NUMBER:.0e}"
        )
    return value


def safe_text(text: str) -> str:
    """`text` with nothing in it that acts in markdown, HTML or a terminal (see _ACTIVE)."""
    text = _CONTROL.sub("", text)
    return "".join(_ACTIVE.get(c, c) for c in text) if any(c in _ACTIVE for c in text) else text
