"""What `dpscale report A B ...` compares in each kind of report, read from report.json as plain
JSON (no bench module, so reports from other machines and older versions compare too): the key
columns rows are matched on, the metrics put side by side, and the setup that must match (the
models measured, the batch, the hardware) before a ratio means anything. compare.py does the
matching and rendering; a new kind of report is one `Figures` entry here.

Rows are matched on key columns, per command:
    allreduce    transport, world_size, bytes              -> time_us, busbw_GBps
    scaling      engine, world_size (+ transport, model,   -> samples_per_s, efficiency
                 mode, per_worker_batch while those are
                 needed to tell a report's points apart)
    scale        engine, world_size                        -> samples_per_s, efficiency
    convergence  world_size                                -> final_loss, test_accuracy
    convergence-weak  world_size        -> time_to_target_s, statistical_efficiency, samples_per_s
    study        model, engine, world_size (+ transport)   -> samples_per_s, efficiency (summary rows)
    predict      world_size                                -> step_ms, samples_per_s, efficiency

Reports of different setups are not like for like: reports that share no model (workload, script)
are refused; a partly different set of models, a different batch or different hardware (CPU,
cores, GPUs) is compared with a one-line warning each, printed and written into the comparison.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dpscale.errors import ConfigError


def _points(results: dict | list) -> list[dict]:
    # a bare list of points, or {"points": [...], ...}: both layouts have been written
    return results if isinstance(results, list) else results["points"]


def _values(*values: object) -> set[str]:
    return {str(v) for v in values if v is not None}


def _scaling_setup(results: dict | list) -> tuple[set[str], set[str]]:
    points = _points(results)
    batch = _values(
        *(
            f"global {p.get('global_batch')}"
            if p.get("mode") == "strong"
            else f"{p.get('per_worker_batch')}/worker"
            for p in points
        )
    )
    return _values(*(p.get("model") for p in points)), batch


def _scale_setup(results: dict) -> tuple[set[str], set[str]]:
    config = results.get("config") or {}
    script = " ".join([config.get("script", "?"), *config.get("args", [])])
    batch = _values(*(f"{p['samples_per_step'] / p['world_size']:g}/worker" for p in results["points"]))
    return {script}, batch


def _study_setup(results: dict) -> tuple[set[str], set[str]]:
    batch = _values(*(f"{r['config'].get('per_worker_batch')}/worker" for r in results.get("scaling", [])))
    return _values(*(r.get("model") for r in results["summary"])), batch


def _predict_setup(results: dict) -> tuple[set[str], set[str]]:
    profile, config = results["profile"], results["config"]
    batch = config.get("per_worker_batch") or profile.get("per_worker_batch")
    return {str(profile.get("model"))}, {f"{batch}/worker"}


@dataclass(frozen=True)
class Figures:
    """What to compare in a command's results."""

    key_columns: tuple[str, ...]  # always part of the row key
    extra_key_columns: tuple[str, ...]  # added, in order, while a report has two rows with one key
    metrics: tuple[str, ...]
    rows: Callable[[dict | list], list[dict]]  # results (report.json) -> flat rows
    # results -> (the models measured, the batches used), each a set of words; empty: not applicable
    setup: Callable[[dict | list], tuple[set[str], set[str]]] = lambda results: (set(), set())


FIGURES: dict[str, Figures] = {
    "allreduce": Figures(("transport", "world_size", "bytes"), (), ("time_us", "busbw_GBps"), _points),
    "scaling": Figures(
        ("engine", "world_size"),
        ("transport", "model", "mode", "per_worker_batch"),
        ("samples_per_s", "efficiency"),
        _points,
        _scaling_setup,
    ),
    "convergence": Figures(
        ("world_size",),
        (),
        ("final_loss", "test_accuracy"),
        lambda r: r["runs"],
        lambda r: (
            _values(r["config"].get("workload")),
            _values(f"global {r['config'].get('global_batch')}"),
        ),
    ),
    "scale": Figures(("engine", "world_size"), (), ("samples_per_s", "efficiency"), _points, _scale_setup),
    "convergence-weak": Figures(  # bench convergence --mode weak
        ("world_size",),
        (),
        ("time_to_target_s", "statistical_efficiency", "samples_per_s"),
        lambda r: r["runs"],
        lambda r: (
            _values(r["config"].get("workload")),
            _values(f"{r['config'].get('batch_per_worker')}/worker"),
        ),
    ),
    "study": Figures(
        ("model", "engine", "world_size"),
        ("transport",),
        ("samples_per_s", "efficiency"),
        lambda r: r["summary"],
        _study_setup,
    ),
    "predict": Figures(
        ("world_size",),
        (),
        ("step_ms", "samples_per_s", "efficiency"),
        lambda r: r["predictions"],
        _predict_setup,
    ),
}


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
