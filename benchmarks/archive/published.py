"""The fit of the published cases' free parameters on the training half, and the held-out study.

Parameters not published for these systems are fitted (`fit`): the achieved fraction of Ethernet's
nominal rate, the step-to-step variation of a GPU's compute and of a node's (stragglers), the
slowdown of backward per ms of communication it hides (interference), the inter-node bandwidth lost
per doubling of the nodes (congestion) and the host's input rate per core. The fit minimises the
largest training error; the held-out error is what the docs report (docs/performance-model.md,
"Published results"). The cases and the split are in published_cases.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from dpscale.lab.predict.degrade import ScaleTerms
from published_case import (
    TARGET_POINTS,
    FitParams,
    PublishedCase,
    Reproduction,
    predict_at,
    reproduce,
)
from published_cases import cases, held_out_cases, training_cases

# What `fit(training_cases())` returns (tests/lab/predict/test_published.py re-fits and compares; the presets'
# ETH_EFFICIENCY, GPU_COMPUTE_CV and GPU_NODE_CV in dpscale/predict/cluster.py carry the same values)
FITTED = FitParams(
    eth_efficiency=0.95, compute_cv=0.02, node_cv=0.005, interference=0.0, congestion_per_doubling=0.0
)

GRID = {
    "eth_efficiency": (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0),
    "compute_cv": (0.0, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04),
    "node_cv": (0.0, 0.005, 0.01, 0.02, 0.03, 0.04),
    "interference": (0.0, 0.1, 0.2, 0.3, 0.5),
    "congestion_per_doubling": (0.0, 0.01, 0.02, 0.03, 0.05),
}


# samples/s per host core for the input pipeline, in the order a tie is broken: unlimited first (a
# term the training half cannot see stays off), then from the fastest down
INPUT_PER_CORE_GRID = (None, 400.0, 300.0, 250.0, 200.0, 175.0, 150.0, 125.0, 100.0, 75.0, 50.0, 25.0)


def fit(train: Sequence[PublishedCase]) -> FitParams:
    """The grid point with the smallest largest training error (then the smallest mean error), then
    the input pipeline's rate per host core given it (`fit_input_per_core`).

    Only Ethernet cases depend on eth_efficiency, so the others are reproduced once per setting of
    the remaining parameters; and a grid point stops being scored once one of its errors is above
    the best largest error so far (it cannot win: the same result as scoring it whole)."""
    others = [k for k in GRID if k != "eth_efficiency"]
    on_eth = [c for c in train if c.on_ethernet]
    rest = [c for c in train if not c.on_ethernet]
    best, best_key = FitParams(), (float("inf"), float("inf"))
    for values in itertools.product(*(GRID[k] for k in others)):
        base = FitParams(**dict(zip(others, values, strict=True)))
        rest_errors = _errors_within(rest, base, best_key[0])
        if rest_errors is None:
            continue
        for eta in GRID["eth_efficiency"]:
            params = replace(base, eth_efficiency=eta)
            eth_errors = _errors_within(on_eth, params, best_key[0])
            if eth_errors is None:
                continue
            errors = rest_errors + eth_errors
            key = (max(errors), sum(errors) / len(errors))
            if key < best_key:
                best, best_key = params, key
    return replace(best, input_per_core=fit_input_per_core(train, best))


def _errors_within(cases: Sequence[PublishedCase], params: FitParams, bound: float) -> list[float] | None:
    """|error| of each case under `params`, or None as soon as one is above `bound`."""
    errors = []
    for c in cases:
        errors.append(abs(reproduce(c, params).error_points))
        if errors[-1] > bound:
            return None
    return errors


def fit_input_per_core(train: Sequence[PublishedCase], params: FitParams) -> float | None:
    """The host input rate per core (INPUT_PER_CORE_GRID) with the smallest largest error on the
    training cases that decode on their hosts (then the smallest mean; ties: the earlier, so
    unlimited). Only those cases depend on it, so it is fitted after the other parameters."""
    fed = [c for c in train if c.host_cores is not None]
    best, best_key = None, (float("inf"), float("inf"))
    for rate in INPUT_PER_CORE_GRID:
        errors = [abs(reproduce(c, replace(params, input_per_core=rate)).error_points) for c in fed]
        key = (round(max(errors), 6), round(sum(errors) / len(errors), 6))
        if key < best_key:
            best, best_key = rate, key
    return best


def input_per_core_lower_bound(train: Sequence[PublishedCase], params: FitParams) -> float:
    """The slowest input rate per host core that leaves every training prediction as it is: what the
    training half says about the rate (it only bounds it from below: no training case waits for data)."""
    bound = 0.0
    for c in train:
        if c.host_cores is None:
            continue
        # the node's demand at the predicted (unlimited) speed, per core
        terms = ScaleTerms(compute_cv=params.compute_cv, node_cv=params.node_cv)
        at_n = predict_at(c, replace(params, input_per_core=None), terms, c.gpus, 1)
        demand = min(c.gpus, c.workers_per_node) * c.per_gpu_batch / (at_n.step_ms / 1e3)
        bound = max(bound, demand / c.host_cores)
    return bound


# each at-scale term switched off in turn: its share is the efficiency gained without it
TERMS_OFF = {
    "no stragglers": ScaleTerms(stragglers=False),
    "nominal bandwidth": ScaleTerms(achieved_bandwidth=False),
    "all terms off": ScaleTerms(
        stragglers=False,
        achieved_bandwidth=False,
        congestion=False,
        overlap_interference=False,
        input_pipeline=False,
    ),
}


@dataclass(frozen=True)
class Study:
    params: FitParams
    rows: list[Reproduction]
    without: dict[str, list[float]]  # TERMS_OFF name -> predicted efficiency per row

    def errors(self, held_out: bool) -> list[float]:
        return [r.error_points for r in self.rows if r.held_out == held_out]


def held_out_study(params: FitParams | None = None) -> Study:
    """Fit on the training half (unless `params` is given) and reproduce every case."""
    params = params or fit(training_cases())
    held = held_out_cases()
    rows = [reproduce(c, params, held_out=c in held) for c in cases()]
    without = {
        name: [reproduce(r.case, params, terms=terms).predicted for r in rows]
        for name, terms in TERMS_OFF.items()
    }
    return Study(params, rows, without)


def format_study(study: Study) -> str:
    p = study.params
    lines = [
        f"fitted on the {len(study.errors(False))} training cases: Ethernet achieved {p.eth_efficiency:.0%} "
        f"of nominal, GPU compute CV {p.compute_cv:.3f}, node CV {p.node_cv:.3f}, "
        f"interference {p.interference:g}, congestion {p.congestion_per_doubling:.0%} per doubling of nodes, "
        "input pipeline "
        + ("unlimited" if p.input_per_core is None else f"{p.input_per_core:g} samples/s per host core")
        + f" (the training half bounds it from below only: >= "
        f"{input_per_core_lower_bound(training_cases(), p):.0f} samples/s per core)",
        "",
        "| case | GPUs | split | published | predicted | error (points) | "
        + " | ".join(TERMS_OFF)
        + " | bottleneck |",
        "|---|---|---|---:|---:|---:|" + "---:|" * len(TERMS_OFF) + "---|",
    ]
    for k, r in enumerate(study.rows):
        c = r.case
        off = " | ".join(f"{study.without[name][k]:.1%}" for name in TERMS_OFF)
        lines.append(
            f"| {c.name} | {c.baseline_gpus} -> {c.gpus} | {'held out' if r.held_out else 'train'} | "
            f"{c.published_efficiency:.1%} | {r.predicted:.1%} | {r.error_points:+.1f} | {off} | "
            f"{r.bottleneck} |"
        )
    bare = [
        100 * (eff - r.case.published_efficiency)
        for eff, r in zip(study.without["all terms off"], study.rows, strict=True)
    ]
    for held, name in ((False, "training"), (True, "held out")):
        for label, errors in (
            (name, study.errors(held)),
            (
                f"{name}, all at-scale terms off",
                [e for e, r in zip(bare, study.rows, strict=True) if r.held_out == held],
            ),
        ):
            errs = [abs(e) for e in errors]
            within = sum(e <= TARGET_POINTS for e in errs)
            lines.append(
                f"\n{label}: {within}/{len(errs)} within {TARGET_POINTS:g} points, mean |error| "
                f"{sum(errs) / len(errs):.1f}, worst {max(errs):.1f} points"
            )
    return "\n".join(lines)
