"""What a bench is (`Bench`): its config, how it measures, what it prints, how its report is
written and re-read, and what `dpscale report A B ...` compares in its reports (`Figures`).

A bench is one module holding its Config, Result, `run` and rendering, ending in one `BENCH =
Bench(...)`; benches.py lists them, and the CLI, `dpscale report` and the study read that list.
Comparisons read report.json as plain JSON (no bench module is needed to compare: reports from
other machines and older versions compare too): the key columns rows are matched on, the metrics
put side by side, and the setup that must match (the models measured, the batch, the hardware)
before a ratio means anything.

Reports of different setups are not like for like: reports that share no model (workload, script)
are refused; a partly different set of models, a different batch or different hardware (CPU,
cores, GPUs) is compared with a one-line warning each, printed and written into the comparison.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dpscale.errors import ConfigError
from dpscale.flags import config_argv
from dpscale.lab.bench.report import ReportDir


def points(results: dict | list) -> list[dict]:
    """A report's points: a bare list of points, or {"points": [...], ...}: both layouts have been written."""
    return results if isinstance(results, list) else results["points"]


def values(*values: object) -> set[str]:
    """The set of words a setup is described by (None left out)."""
    return {str(v) for v in values if v is not None}


@dataclass(frozen=True)
class Figures:
    """What to compare in a command's results."""

    key_columns: tuple[str, ...]  # always part of the row key
    extra_key_columns: tuple[str, ...]  # added, in order, while a report has two rows with one key
    metrics: tuple[str, ...]
    rows: Callable[[Any], list[dict]]  # results (report.json) -> flat rows
    # results -> (the models measured, the batches used), each a set of words; empty: not applicable
    setup: Callable[[Any], tuple[set[str], set[str]]] = lambda results: (set(), set())


def _hardware(system: dict | None) -> str | None:
    hw = (system or {}).get("hardware")
    if not hw:
        return None
    gpus = ", ".join(hw.get("gpus") or []) or "no GPU"
    return f"{hw.get('cpu_model')}, {hw.get('usable_cores')} usable cores, {gpus}"


def check_setups(
    figures: Figures, labels: Sequence[str], directories: Sequence, docs: Sequence[dict]
) -> list[str]:
    """One warning line per way the reports differ in setup; ValueError when they share no model."""
    setups = []
    for d, doc in zip(directories, docs, strict=True):
        try:
            setups.append(figures.setup(doc["results"]))
        except (KeyError, TypeError, AttributeError, ZeroDivisionError) as e:
            raise ConfigError(
                f"{d}: its report.json results are not a {doc['command']} result ({e!r})"
            ) from None
    models = [m for m, _ in setups]
    each = lambda sets: "; ".join(
        f"{x} {', '.join(sorted(s)) or '?'}" for x, s in zip(labels, sets, strict=True)
    )
    warnings = []
    if all(models) and not set.intersection(*models):
        raise ConfigError(
            f"cannot compare reports of different models ({each(models)}): the figures are not like for "
            f"like; compare reports of the same model"
        )
    if any(m != models[0] for m in models):
        warnings.append(f"the reports measured different models ({each(models)}); rows one lacks show '-'")
    batches = [b for _, b in setups]
    if any(b != batches[0] for b in batches):
        warnings.append(f"the batch differs ({each(batches)}): throughput is not like for like")
    hardware = [_hardware(doc.get("system")) for doc in docs]
    if None not in hardware and len(set(hardware)) > 1:
        warnings.append(
            "the hardware differs ("
            + "; ".join(f"{x} {h}" for x, h in zip(labels, hardware, strict=True))
            + "): a ratio compares machines, not only the change"
        )
    return warnings


def _no_warnings(result: Any) -> list[str]:
    return []


def _exit_ok(result: Any) -> int:
    return 0


@dataclass(frozen=True)
class Bench:
    """One bench: what differs between benches is data; the order of what the user sees (results,
    warnings, where the report is, then the --json line) is the same for all (cli/bench.py)."""

    command: str  # report.json's "command" and the report directory's prefix
    argv: tuple[str, ...]  # the dpscale command that runs it, before its config's flags
    help: str  # its line in `dpscale --help`
    Config: type  # its config dataclass: the command's flags are its fields (flags.py)
    # config -> result: a lambda calling the measurement module's `run`, looked up at each call so
    # that a test can replace it
    run: Callable[..., Any]
    from_dict: Callable[[dict], Any]  # report.json's "results" -> the Result again
    write_report: Callable[[Any, ReportDir], None]  # the Result -> a report directory
    compare: Figures  # what `dpscale report A B` puts side by side
    text: Callable[[Any], list[str]]  # result -> the terminal lines, before the warnings
    json_line: Callable[[Any], str]  # result -> what --json prints last
    warnings: Callable[[Any], list[str]] = _no_warnings
    exit_code: Callable[[Any], int] = _exit_ok
    # the config's fields the command sets where a flag does not (the API's defaults differ)
    defaults: Callable[[], dict] = dict

    def command_line(self, config: object) -> list[str]:
        """The command that runs this bench with `config` on its own, exactly (defaults written)."""
        return ["dpscale", *self.argv, *config_argv(config)]
