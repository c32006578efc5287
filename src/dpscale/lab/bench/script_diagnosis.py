"""The diagnosis at the end of `dpscale scale`: what the script does wrong, and why N workers are
not N times faster, ranked by what each cause costs, each followed by the fix to try.

Causes come from the measurements of each world size N > 1 (script_phases.py): exposed
communication, data wait (per rank where one dominates), a straggler's compute, a per-worker
batch smaller than at N=1 (nanoGPT divides its accumulation by N: fixed per-step costs weigh more),
compute growth (workers sharing cores and memory) and all-reduces on accumulation micro-steps.
Each has its ms per step and the efficiency points it costs (its share of the counted step).

A fix's gain is `dpscale predict`'s (lab/predict/model.py) with the profile scale measured at N=1
on this machine's links (the cpu-shm or cpu-loopback-gloo preset, with the compute growth measured
at N as contention): the predicted efficiency with the fix minus the predicted one without. It is
labelled as predicted; `--try` measures it (the tries' rows). `--try accumulation=K` is a timing
trial (launch/engine_try.py): it drops the all-reduce of K - 1 of every K steps while the script's
work per step stays, so its rows are predicted as that (`trial=True`: the step without its exposed
communication and the interference on K - 1 of K steps); the advice predicts real accumulation
(each rank's batch K times larger: per-step costs amortized too), and says how much of that the
trial can show. fp16's gain counts what casting to
fp16 and back costs this host's cores (predict/compression_cost.py, measured by scale after the
N=1 run): on a CPU it can exceed what the halved transfer saves. A fix predicted to lose is not
advised; its line says why. Where the model has no term for a
fix (DataLoader workers: scale measures no input rate), the cause's own cost bounds the gain.

The script checks (launch/script_checks.py) come first, and one needs every world size: a learning
rate left unchanged while the global batch grew with N.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from dpscale.errors import ConfigError
from dpscale.lab.bench.script_phases import COMPUTE, lost_points
from dpscale.lab.bench.script_scaling import ScalePoint, ScaleResult
from dpscale.lab.predict.cluster import preset_cluster
from dpscale.lab.predict.compression_cost import CompressionCost
from dpscale.lab.predict.degrade import INTERFERENCE
from dpscale.lab.predict.model import PredictConfig, Prediction, predict
from dpscale.lab.predict.profile import ModelProfile
from dpscale.launch.engine_try import EngineTry, parse_try

MIN_POINTS = 0.5  # a cause costing less than this many efficiency points is noise next to the rest
DEFAULT_TRIES = ("fp16", "bucket_cap_mb=50", "accumulation=2")  # what exposed communication suggests
GROWN = 1.5  # global samples per optimizer step grown this much: the lr should have followed


@dataclass(frozen=True)
class Cause:
    point: ScalePoint
    what: str  # "exposed communication", "rank 1 waits for data 45% of its step", ...
    ms: float  # per step
    points: float  # efficiency points
    fix: str  # the fix to try, in words, its gain included


def _at(p: ScalePoint) -> str:
    return f"N={p.world_size} ({p.engine})"


def _cluster_name(p: ScalePoint) -> str:
    return "cpu-loopback-gloo" if p.transport == "gloo" else "cpu-shm"


def _contention(p: ScalePoint, base: ScalePoint, work: float) -> float:
    """How much slower the fastest rank computed at N than the 1-worker run, per unit of work."""
    assert p.phases and base.phases  # callers check
    fastest = min(sum(r["median"][k] for k in COMPUTE) for r in p.phases)
    one = sum(base.phases[0]["median"][k] for k in COMPUTE) * work
    return max(1.0, fastest / one) if one > 0 else 1.0


def predicted_gain(
    result: ScaleResult, p: ScalePoint, fix: EngineTry, *, trial: bool = False
) -> float | None:
    """Efficiency points `dpscale predict` expects `fix` to add at `p`'s world size (None: no profile).

    `trial`: for accumulation, what `--try` runs (the all-reduce of K - 1 of K steps dropped, the
    same work per step) rather than real accumulation (a K times larger batch per rank)."""
    base = next((b for b in result.points if b.world_size == 1 and b.engine == p.engine), None)
    if result.profile is None or base is None or not (p.phases and base.phases):
        return None
    try:
        profile = ModelProfile.from_dict(result.profile)
    except (ConfigError, TypeError, KeyError):
        return None
    n, work = p.world_size, p.samples_per_step / p.world_size / base.samples_per_step
    # the script leaves DDP's buckets at their default: a 1 MiB first bucket, then 25 MiB. The shm
    # transport reduces on the thread that runs backward (engine/reducer.py): nothing of it
    # overlaps, so its reductions add to the step as if each waited for the end of backward
    plain = PredictConfig(
        world_sizes=[n],
        first_bucket_mb=1.0,
        contention=_contention(p, base, work),
        overlap=p.transport != "shm",
    )
    tried, tried_profile = plain, profile
    if fix.kind == "fp16":
        tried = replace(plain, compression=2.0, compression_cost=_cast_cost(result, p))
    elif fix.kind == "bucket_cap_mb":
        tried = replace(plain, bucket_mb=float(fix.value or 25.0), first_bucket_mb=None)
    elif fix.kind == "accumulation":
        by_n = {**profile.per_worker_batch_by_world_size, n: int(profile.work_at(n) * (fix.value or 1))}
        tried_profile = replace(profile, per_worker_batch_by_world_size=by_n)
    # every worker on this host (across hosts: as many per host as scale ran)
    per_host = n // (result.config.nnodes or 1)
    cluster = replace(preset_cluster(_cluster_name(p)), workers_per_node=max(1, per_host))
    before = predict(profile, cluster, plain)[0]
    if fix.kind == "accumulation" and trial:
        return 100 * (_trial_efficiency(before, int(fix.value or 1)) - before.efficiency)
    after = predict(tried_profile, cluster, tried)[0]
    return 100 * (after.efficiency - before.efficiency)


def _trial_efficiency(before: Prediction, k: int) -> float:
    """The accumulation trial: one step in k as predicted, k - 1 without their exposed reductions
    and the slowdown reductions cause beside backward; the same samples in each step."""
    quiet_ms = before.step_ms - before.exposed_comm_ms - before.losses_ms.get(INTERFERENCE, 0.0)
    trial_ms = (before.step_ms + (k - 1) * quiet_ms) / k
    return before.efficiency * before.step_ms / trial_ms


def _cast_cost(result: ScaleResult, p: ScalePoint) -> CompressionCost | None:
    """This host's fp16 cast rates as measured by scale (None in reports older than them); the
    shm transport stages the compressed copy, gloo does not."""
    if not result.compression_cost:
        return None
    return replace(CompressionCost.from_dict(result.compression_cost), staged=p.transport == "shm")


def _comm_fix(result: ScaleResult, p: ScalePoint) -> str:
    gains = [(parse_try(flag), predicted_gain(result, p, parse_try(flag))) for flag in DEFAULT_TRIES]
    gains.sort(key=lambda fg: -(fg[1] if fg[1] is not None else float("-inf")))  # the best first
    parts = [
        f"{fix.label} {f'predicted {gain:+.1f} points' if gain is not None else 'not predicted'} "
        f"{_tried_by(result, p, fix)}"
        for fix, gain in gains
        if gain is None or gain >= 0
    ]
    # a fix predicted to lose is not advised; one line says why
    worse = [
        f"not {fix.label}: predicted {gain:+.1f} points, {_why_worse(fix)}"
        for fix, gain in gains
        if gain is not None and gain < 0
    ]
    return "; ".join(filter(None, ["try " + "; ".join(parts) if parts else "", *worse]))


def _tried_by(result: ScaleResult, p: ScalePoint, fix: EngineTry) -> str:
    """How --try measures the fix: accumulation's trial shows only its communication part."""
    if fix.kind != "accumulation":
        return f"(--try {fix.flag})"
    part = predicted_gain(result, p, fix, trial=True)
    said = f"{part:+.1f}" if part is not None else "not predicted"
    return f"(its communication part {said}: what --try {fix.flag} measures)"


def _why_worse(fix: EngineTry) -> str:
    if fix.kind == "fp16":
        return (
            "casting gradients to fp16 and back costs this host's cores more than the halved transfer saves"
        )
    if fix.kind == "bucket_cap_mb":
        return "larger buckets start communicating later in backward"
    return "the model expects it to cost more than it saves"


def _causes_at(result: ScaleResult, p: ScalePoint) -> list[Cause]:
    lost = p.lost_points or {}
    ms = {k: v * p.step_ms / 100 for k, v in lost.items()}
    out = []
    if lost.get("exposed communication", 0.0) > 0:
        out.append(
            Cause(
                p,
                "exposed communication",
                ms["exposed communication"],
                lost["exposed communication"],
                _comm_fix(result, p),
            )
        )
    for s in p.stragglers:
        cost = lost_points(p.step_ms, s["excess_ms"]) or 0.0
        if s["cause"] == "compute":
            out.append(
                Cause(
                    p,
                    f"rank {s['rank']} compute +{s['excess_ms']:.1f} ms/step over the other ranks: "
                    "a straggler",
                    s["excess_ms"],
                    cost,
                    f"find what slows rank {s['rank']} (its host, its data, its device); "
                    f"up to {cost:+.1f} points",
                )
            )
        else:
            out.append(
                Cause(
                    p,
                    f"rank {s['rank']} waits for data {s['share']:.0%} of its step",
                    s["excess_ms"],
                    cost,
                    f"raise its DataLoader num_workers (or pin_memory, prefetch); up to {cost:+.1f} points, "
                    "not predicted (scale measures no input rate)",
                )
            )
    if not any(s["cause"] == "data wait" for s in p.stragglers) and lost.get("data wait", 0.0) >= MIN_POINTS:
        out.append(
            Cause(
                p,
                "data wait on every rank",
                ms["data wait"],
                lost["data wait"],
                f"raise the DataLoader's num_workers; up to {lost['data wait']:+.1f} points, not predicted",
            )
        )
    out += _compute_causes(result, p, lost, ms)
    if p.micro_step_comm_ms:
        cost = lost_points(p.step_ms, p.micro_step_comm_ms) or 0.0
        out.append(
            Cause(
                p,
                f"all-reduce on accumulation micro-steps ({p.synced_per_optimizer_step:g} per "
                "optimizer step)",
                p.micro_step_comm_ms,
                cost,
                f"run all but the last micro-step under model.no_sync(); at least {cost:+.1f} "
                "points (measured)",
            )
        )
    return out


def _compute_causes(result: ScaleResult, p: ScalePoint, lost: dict, ms: dict) -> list[Cause]:
    grown = lost.get("compute growth", 0.0)
    if grown < MIN_POINTS:
        return []
    base = next((b for b in result.points if b.world_size == 1 and b.engine == p.engine), None)
    each = p.samples_per_step / p.world_size
    if base is not None and each < base.samples_per_step:
        fix = parse_try("accumulation=2")
        gain = predicted_gain(result, p, fix)
        said = f"predicted {gain:+.1f} points" if gain is not None else "not predicted"
        said += f" {_tried_by(result, p, fix)}"
        return [
            Cause(
                p,
                f"per-worker batch too small ({each:g} samples per optimizer step against "
                f"{base.samples_per_step:g} at N=1: per-step costs weigh more)",
                ms["compute growth"],
                grown,
                f"raise each rank's batch or its accumulation: accumulation 2 {said}",
            )
        ]
    return [
        Cause(
            p,
            "compute growth (workers share this host's cores and memory)",
            ms["compute growth"],
            grown,
            "fewer intra-op threads per worker or more cores per worker; not predicted",
        )
    ]


def causes(result: ScaleResult) -> list[Cause]:
    """Every world size's causes, largest cost first; those under MIN_POINTS left out."""
    found = [c for p in result.points if p.world_size > 1 for c in _causes_at(result, p)]
    return sorted((c for c in found if c.points >= MIN_POINTS), key=lambda c: -c.points)


def lr_unchanged(points: Sequence[ScalePoint]) -> list[str]:
    """A learning rate left as it was at the smallest N while the global batch grew with N. Ranks
    that never synchronized (no DDP model) have no global batch: their rows say so instead."""
    lines = []
    for engine in dict.fromkeys(p.engine for p in points):
        mine = sorted(
            (p for p in points if p.engine == engine and p.learning_rates and p.synchronized),
            key=lambda p: p.world_size,
        )
        if len(mine) < 2:
            continue
        first = mine[0]
        for p in mine[1:]:
            k = min(len(first.learning_rates), len(p.learning_rates))
            same = k > 0 and all(
                abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1e-30)
                for a, b in zip(first.learning_rates[:k], p.learning_rates[:k], strict=True)
            )
            if same and p.samples_per_step >= GROWN * first.samples_per_step:
                factor = p.samples_per_step / first.samples_per_step
                lines.append(
                    f"learning rate unchanged ({first.learning_rates[0]:g} at the first optimizer "
                    f"step) at N={first.world_size} and N={p.world_size} ({engine}) while the global "
                    f"batch grew {factor:g}x ({first.samples_per_step:g} -> {p.samples_per_step:g} "
                    "samples per optimizer step): scale the lr with the global batch (x"
                    f"{factor:g} by the linear rule for SGD, with a warm-up) or keep the global batch "
                    "fixed (each rank's batch / N)"
                )
    return lines


def checks(result: ScaleResult) -> list[str]:
    """The script's problems, each once over every world size."""
    lines = [line for p in result.points for line in p.checks]
    return list(dict.fromkeys([*lines, *lr_unchanged(result.points)]))


def render(result: ScaleResult) -> list[str]:
    """The checks, then the ranked causes, then the tries' predicted-vs-measured lines."""
    lines = [f"check: {line}" for line in checks(result)]
    ranked = causes(result)
    if ranked:
        lines.append("diagnosis, largest cost first (efficiency points lost at N):")
        lines += [
            f"{k}. {_at(c.point)}: {c.what}: {c.ms:.1f} ms/step ({c.points:.1f} points): {c.fix}"
            for k, c in enumerate(ranked, 1)
        ]
    return lines + tries(result)


def tries(result: ScaleResult) -> list[str]:
    """--try: each fix's measured efficiency beside the predicted one, at the largest N."""
    if result.try_refusal:
        return [result.try_refusal]
    if not result.tries:
        return []
    n = result.tries[0].world_size
    at_n = next((p for p in result.points if p.world_size == n and p.engine == "dpscale"), None)
    if at_n is None or at_n.efficiency is None:
        return []
    lines = [f"--try at N={n}: efficiency without a fix {at_n.efficiency:.1%} (measured)"]
    for t in result.tries:
        fix = parse_try(t.note or "")
        gain = predicted_gain(result, at_n, fix, trial=True)
        predicted = f"{at_n.efficiency + gain / 100:.1%} ({gain:+.1f} points)" if gain is not None else "-"
        if fix.kind == "accumulation":
            # what the trial runs; the advice's figure is real accumulation's, a larger batch per rank
            real = predicted_gain(result, at_n, fix)
            predicted += (
                f" for the trial (one all-reduce per {fix.value:g} steps, the same work per step; "
                f"real accumulation {real:+.1f} points)"
                if real is not None
                else ""
            )
        measured = (
            f"{t.efficiency:.1%} ({100 * (t.efficiency - at_n.efficiency):+.1f} points)"
            if t.efficiency is not None
            else "-"
        )
        lines.append(f"  {fix.label}: predicted {predicted}, measured {measured}")
    return lines
