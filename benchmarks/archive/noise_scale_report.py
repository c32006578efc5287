"""benchmarks/archive/noise_scale_validation.py's arithmetic, from the runs to the tables (no process):
per batch the median steps over the seeds and the pooled noise scales (`aggregate`), the rate
tuned per batch over the factors tried (`tune`), the steps predicted six ways by
S(B) = S_min (1 + B_noise / B) and their errors (`predictions`), the least-squares fit of every
batch (`fitted`), the error's band over bootstrap resamples of the seeds (`error_bands`), and the
markdown table (`table`). The rules are the validation script's docstring's, fixed before any
result was seen; `report` applies them to the runs of one or more --json files."""

from __future__ import annotations

import math
import random
import statistics

from dpscale.lab.predict import goodput

TOLERANCE = 0.25  # |predicted / measured - 1| within this: the model holds at that batch


def median_steps(steps: list[int | None]) -> float | None:
    """The median with a miss (None) counted as infinitely many steps; None when it lands on a miss."""
    value = statistics.median([math.inf if s is None else s for s in steps])
    return None if math.isinf(value) else value


def _pooled(runs: list[dict], trace: str, grad_sq: str) -> float | None:
    if any(r.get(trace) is None for r in runs):  # .get: files from before a measurement existed
        return None
    denominator = sum(r[grad_sq] for r in runs)
    return sum(r[trace] for r in runs) / denominator if denominator > 0 else None


def tune(runs: list[dict]) -> list[dict]:
    """Per batch, the runs at the learning-rate factor whose median steps are fewest (a tie goes to
    the factor nearest 1): the rate tuned per batch over the grid, as S(B) assumes. Runs of one
    factor are all kept (ordered by batch)."""
    kept = []
    for k in sorted({r["multiplier"] for r in runs}):
        same = [r for r in runs if r["multiplier"] == k]
        by_factor = {}
        for r in same:
            by_factor.setdefault(r.get("lr_factor", 1.0), []).append(r)

        def cost(item):
            factor, chosen = item
            median = median_steps([r["steps_to_target"] for r in chosen])
            return (math.inf if median is None else median, abs(math.log(factor)))

        kept += min(by_factor.items(), key=cost)[1]
    return kept


def rows_for(runs: list[dict]) -> list[dict]:
    """The rows with predictions for one task's runs (the rate tuned per batch when several factors ran)."""
    return predictions(aggregate(tune(runs)))


def aggregate(runs: list[dict]) -> list[dict]:
    """One row per batch over the seeds: the median steps and their min-max, the pooled noise
    scales (plain and Adam's) and the mean late one."""
    rows = []
    for k in sorted({r["multiplier"] for r in runs}):
        same = [r for r in runs if r["multiplier"] == k]
        reached = [r["steps_to_target"] for r in same if r["steps_to_target"] is not None]
        lates = [r["late_noise_scale"] for r in same if r["late_noise_scale"] is not None]
        rows.append(
            {
                "task": same[0]["task"],
                "multiplier": k,
                "global_batch": same[0]["global_batch"],
                "seeds": len(same),
                "steps": [r["steps_to_target"] for r in same],
                "steps_to_target": median_steps([r["steps_to_target"] for r in same]),
                "min_steps": min(reached, default=None),
                "max_steps": max(reached, default=None),
                "missed": len(same) - len(reached),
                "coarse_hits": sum(r["coarse_hit"] for r in same),
                "noise_scale": _pooled(same, "trace_sum", "grad_sq_sum"),
                "late_noise_scale": statistics.fmean(lates) if lates else None,
                "adam_noise_scale": _pooled(same, "adam_trace_sum", "adam_grad_sq_sum"),
                "hessian_noise_scale": _pooled(same, "hessian_trace_sum", "hessian_grad_sq_sum"),
                "hessian_adam_noise_scale": _pooled(
                    same, "hessian_adam_trace_sum", "hessian_adam_grad_sq_sum"
                ),
                "mean_gain": statistics.fmean(r["mean_gain"] for r in same),
                "lr_factor": statistics.fmean(r.get("lr_factor", 1.0) for r in same),
            }
        )
    return rows


def _law(s_at_b: float, b: int, noise: float):
    """S(.) through S(b) = s_at_b with B_noise = noise: the law `dpscale predict --goodput` uses."""
    s_min = goodput.s_min_from_run(s_at_b, b, noise)
    return lambda batch: goodput.steps_to_target(batch, s_min=s_min, noise_scale=noise)


def two_point_law(rows: list[dict]):
    """S_min and B_noise solved from the measured steps at B and 2B alone (two equations, two
    unknowns: S(B) - S(2B) = S_min B_noise / 2B), or None when those do not give a positive law."""
    at = {r["multiplier"]: r["steps_to_target"] for r in rows}
    s1, s2 = at.get(1), at.get(2)
    b = next(r["global_batch"] for r in rows if r["multiplier"] == 1)
    if not s1 or not s2 or not s1 > s2:
        return None
    s_min = 2 * s2 - s1
    if not s_min > 0:
        return None
    return _law(s1, b, 2 * b * (s1 - s2) / s_min)


PREDICTIONS = {  # suffix of the row's keys -> what the prediction's B_noise is
    "": "noise scale at B (pooled over seeds)",
    "_late": "late noise scale at B",
    "_fit2": "fit to B and 2B",
    "_adam": "Adam-preconditioned noise scale at B",
    "_hess": "Hessian noise scale at B",
    "_hess_adam": "Adam-preconditioned Hessian noise scale at B",
}


NOISE_COLUMNS = (
    "noise_scale",
    "late_noise_scale",
    "adam_noise_scale",
    "hessian_noise_scale",
    "hessian_adam_noise_scale",
)


def predictions(rows: list[dict]) -> list[dict]:
    """Each row with the steps S(kB) predicted four ways and their relative errors against the
    measured (median) steps: `predicted_steps` from the run at B and its noise scale;
    `predicted_late` with its late noise scale; `predicted_fit2` from the steps at B and 2B (4B and
    beyond); `predicted_adam` with the noise scale of Adam's preconditioned gradient;
    `predicted_hess` with tr(H Sigma) / G^T H G and `predicted_hess_adam` with its preconditioned
    form (benchmarks/archive/noise_scale_hessian.py)."""
    base = next(r for r in rows if r["multiplier"] == 1)
    b, s_b = base["global_batch"], base["steps_to_target"]

    def from_noise(key):
        return _law(s_b, b, base[key]) if s_b and base.get(key) else None

    laws = {
        "": from_noise("noise_scale"),
        "_late": from_noise("late_noise_scale"),
        "_fit2": two_point_law(rows),
        "_adam": from_noise("adam_noise_scale"),
        "_hess": from_noise("hessian_noise_scale"),
        "_hess_adam": from_noise("hessian_adam_noise_scale"),
    }
    out = []
    for r in rows:
        row = dict(r)
        for suffix, law in laws.items():
            pred_key = "predicted_steps" if suffix == "" else "predicted" + suffix
            row[pred_key] = row["error" + suffix] = row["within" + suffix] = None
            if law is None or (suffix == "_fit2" and r["multiplier"] <= 2):
                continue
            row[pred_key] = law(r["global_batch"])
            if r["steps_to_target"]:
                row["error" + suffix] = row[pred_key] / r["steps_to_target"] - 1
                row["within" + suffix] = abs(row["error" + suffix]) <= TOLERANCE
        out.append(row)
    return out


def fitted(rows: list[dict]) -> tuple[float, float] | None:
    """(S_min, B_noise) that fit every measured S(B) best (least squares on S = S_min + S_min B_noise / B,
    linear in 1/B): what the noise scale would have had to be for the law to hold, to compare with
    the measured one. None with fewer than two reached rows or a fit that is not positive."""
    points = [(1 / r["global_batch"], r["steps_to_target"]) for r in rows if r["steps_to_target"]]
    if len(points) < 2:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    s_min = my - slope * mx
    return (s_min, slope / s_min) if s_min > 0 and slope > 0 else None


def error_bands(runs: list[dict], *, draws: int = 1000, seed: int = 0) -> dict[tuple[int, str], tuple]:
    """How much the seeds alone move each prediction's error: the p10-p90 of the error over `draws`
    bootstrap resamples of the seeds (the same seeds drawn for every batch, so each draw is a whole
    repetition of the experiment), keyed by (multiplier, prediction suffix)."""
    seeds = sorted({r["seed"] for r in runs})
    by_seed = {s: [r for r in runs if r["seed"] == s] for s in seeds}
    rng = random.Random(seed)
    errors: dict[tuple[int, str], list[float]] = {}
    for _ in range(draws):
        drawn = [r for _ in seeds for r in by_seed[rng.choice(seeds)]]
        for row in rows_for(drawn):
            for suffix in PREDICTIONS:
                if row["error" + suffix] is not None:
                    errors.setdefault((row["multiplier"], suffix), []).append(row["error" + suffix])
    bands = {}
    for key, values in errors.items():
        if len(values) >= 2:
            cuts = statistics.quantiles(values, n=10)
            bands[key] = (cuts[0], cuts[-1])
    return bands


def _num(value, fmt: str = ".0f") -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: list[dict]) -> str:
    heads = " | ".join(f"{what} (error [p10..p90 over the seeds])" for what in PREDICTIONS.values())
    lines = [
        f"| task | B | steps: median (min-max, missed/seeds) | {heads} "
        "| noise scale: pooled / late / Adam / Hessian / Adam Hessian | mean LR gain x factor |",
        "|:---|---:|---:|" + "---:|" * len(PREDICTIONS) + "---:|---:|",
    ]

    def cell(r, suffix):
        pred = r["predicted_steps" if suffix == "" else "predicted" + suffix]
        if pred is None:
            return "-"
        if r["multiplier"] == 1:
            return f"{pred:.1f} (fit)"
        band = r.get("band" + suffix)
        band = f" [{band[0]:+.0%}..{band[1]:+.0%}]" if band else ""
        return f"{pred:.1f} ({_num(r['error' + suffix], '+.0%')}{band})"

    for r in rows:
        measured = "not reached" if r["steps_to_target"] is None else f"{r['steps_to_target']:g}"
        spread = f"{_num(r['min_steps'])}-{_num(r['max_steps'])}, {r['missed']}/{r['seeds']}"
        noise = " / ".join(_num(r[k], ".0f" if (r[k] or 0) >= 10 else ".2g") for k in NOISE_COLUMNS)
        cells = [r["task"], r["global_batch"], f"{measured} ({spread})"]
        cells += [cell(r, suffix) for suffix in PREDICTIONS] + [
            noise,
            f"{r['mean_gain']:.2f} x {r.get('lr_factor', 1.0):g}",
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def report(runs: list[dict]) -> dict:
    """Per task: the rows with predictions, each error's band over the seeds ("band" + suffix: its
    bootstrap p10-p90) and the least-squares fit of all batches; with several learning-rate
    factors, once at the factor 1 (AdaScale's rate) as "NAME" and once tuned per batch as
    "NAME, rate tuned" (the selection redone in every bootstrap draw)."""
    out = {}
    for name in dict.fromkeys(r["task"] for r in runs):
        mine = [r for r in runs if r["task"] == name]
        variants = {name: [r for r in mine if r.get("lr_factor", 1.0) == 1.0]}
        if len({r.get("lr_factor", 1.0) for r in mine}) > 1:
            variants[f"{name}, rate tuned"] = mine
        for label, chosen in variants.items():
            if not chosen:
                continue
            rows, bands = rows_for(chosen), error_bands(chosen)
            for row in rows:
                for suffix in PREDICTIONS:
                    row["band" + suffix] = bands.get((row["multiplier"], suffix))
            out[label] = {"rows": rows, "fit": fitted(rows)}
    return out


def drop_split(runs: list[dict], fraction: float = 0.9) -> list[dict]:
    """Where each batch's steps go: per run that reached the target, the steps until the eval loss
    first falls to `fraction` of its first evaluation (the start: leaving the initial plateau) and
    the steps from there to the target (the drop); per batch their medians and min-max over those
    runs, and the median share of the start in the steps. Runs without a curve (files of older
    versions) are left out, and so are runs that met a target above the level; a batch with none
    gives no row."""
    rows = []
    for k in sorted({r["multiplier"] for r in runs}):
        starts, drops, shares = [], [], []
        for r in runs:
            curve = r.get("eval_losses")
            if r["multiplier"] != k or not curve or r["steps_to_target"] is None:
                continue
            level = fraction * curve[0][1]
            start = next((step for step, loss in curve if loss <= level), None)
            if start is None:  # a target above the level: no plateau to leave
                continue
            starts.append(start)
            drops.append(r["steps_to_target"] - start)
            shares.append(start / r["steps_to_target"])
        if starts:
            same = next(r for r in runs if r["multiplier"] == k)
            rows.append(
                {
                    "task": same["task"],
                    "multiplier": k,
                    "global_batch": same["global_batch"],
                    "runs": len(starts),
                    "start": statistics.median(starts),
                    "start_range": (min(starts), max(starts)),
                    "drop": statistics.median(drops),
                    "drop_range": (min(drops), max(drops)),
                    "start_share": statistics.median(shares),
                }
            )
    return rows


def drop_table(rows: list[dict], fraction: float = 0.9) -> str:
    lines = [
        f"| task | B | runs | steps to {fraction:g} x the first eval loss: median (min-max) "
        "| steps from there to the target | share of the steps before it |",
        "|:---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        start, drop = r["start_range"], r["drop_range"]
        lines.append(
            f"| {r['task']} | {r['global_batch']} | {r['runs']} | {r['start']:g} ({start[0]}-{start[1]}) "
            f"| {r['drop']:g} ({drop[0]}-{drop[1]}) | {r['start_share']:.0%} |"
        )
    return "\n".join(lines)
