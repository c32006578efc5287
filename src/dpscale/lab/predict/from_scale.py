"""Calibrate a prediction from the user's own measured run (`dpscale predict --from-scale REPORT`).

A `dpscale scale` report (or a `dpscale bench scaling` one) holds the job's step time at a few world
sizes on the user's own machines. From it:

- compute: one worker's step at N = 1 as measured; the profile (the report's own, from `dpscale
  scale`'s one-worker run, or --profile, or --params) is scaled so that its compute is that step;
- the local fabric: the link of the level the largest measured N > 1 used (intra-node on one host,
  inter-node across hosts) is fitted so that the model's step at that N is the measured one (its
  bandwidth, by bisection; achieved figures, efficiency 1). Where even an infinitely fast link
  leaves the model's step above the measured one (the measured run hid all its communication), the
  preset's link is kept and the source says so.

Then `predict` carries the job to larger N. The report is read as untrusted input (bench/report.py's
reader: bounded nesting and numbers, text made inert).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dpscale.errors import ConfigError
from dpscale.lab.bench.report import read_report
from dpscale.lab.predict.cluster import Cluster
from dpscale.lab.predict.model import PredictConfig, check_bounds, predict
from dpscale.lab.predict.profile import ModelProfile

FLAG = "--from-scale"
_BISECT_STEPS = 16  # 8 decades of rate to 0.03%
_NEEDED = ("world_size", "step_ms")


@dataclass(frozen=True)
class ScaleRun:
    """The measured steps of one engine of a scaling report."""

    path: str
    engine: str
    step_ms: dict[int, float]  # world size -> measured step (median, slowest rank)
    hosts: dict[int, int]  # world size -> hosts the ranks ran on (1 where the report does not say)
    profile: dict | None  # `dpscale scale`'s one-worker profile document, if it has one


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"{where}: expected a number > 0, got {value!r}")
    return float(value)


def read_scale_report(location: str, engine: str | None = None) -> ScaleRun:
    """The steps of `engine` (default dpscale, else the report's first) in a scaling report."""
    doc = read_report(location, flag=FLAG)
    results = doc["results"]
    points = results.get("points") if isinstance(results, dict) else None
    if not isinstance(points, list) or not points or not all(isinstance(p, dict) for p in points):
        raise ConfigError(
            f"{FLAG}: {location} is not a `dpscale scale` or `bench scaling` report (no points)"
        )
    engines = list(dict.fromkeys(str(p.get("engine")) for p in points))
    chosen = engine if engine in engines else ("dpscale" if "dpscale" in engines else engines[0])
    step_ms: dict[int, float] = {}
    hosts: dict[int, int] = {}
    for k, p in enumerate(points):
        if str(p.get("engine")) != chosen:
            continue
        where = f"{FLAG}: {location}: points[{k}]"
        if any(key not in p for key in _NEEDED):
            raise ConfigError(f"{where} lacks {', '.join(key for key in _NEEDED if key not in p)}")
        n = p["world_size"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"{where}.world_size: expected an integer >= 1, got {n!r}")
        step_ms[n] = _number(p["step_ms"], f"{where}.step_ms")
        h = p.get("hosts")
        hosts[n] = h if isinstance(h, int) and not isinstance(h, bool) and 1 <= h <= n else 1
    if 1 not in step_ms:
        raise ConfigError(f"{FLAG}: {location} has no N = 1 step for {chosen}: it calibrates compute from it")
    if len(step_ms) < 2:
        raise ConfigError(f"{FLAG}: {location} measured {chosen} at N = 1 only; the fabric needs N > 1")
    profile = results.get("profile") if isinstance(results.get("profile"), dict) else None
    return ScaleRun(str(location), chosen, step_ms, hosts, profile)


def report_profile(run: ScaleRun) -> ModelProfile:
    """The report's own one-worker profile (`dpscale scale` writes one)."""
    if run.profile is None:
        raise ConfigError(
            f"{FLAG}: {run.path} holds no profile (a `bench scaling` report): give --profile FILE or "
            "--params N (the step at N = 1 comes from the report)"
        )
    try:
        return ModelProfile.from_dict(run.profile)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ConfigError(f"{FLAG}: {run.path}: its profile does not read: {type(e).__name__}") from None


def calibrated_compute(profile: ModelProfile, run: ScaleRun) -> ModelProfile:
    """`profile` scaled so that one worker's compute is the measured N = 1 step."""
    plain = replace(profile, per_worker_batch_by_world_size={})
    f = run.step_ms[1] / plain.compute_ms if plain.compute_ms > 0 else 1.0
    params = tuple(replace(p, ready_ms=p.ready_ms * f) for p in profile.params)
    return replace(
        profile,
        forward_ms=profile.forward_ms * f,
        backward_ms=profile.backward_ms * f,
        optimizer_ms=profile.optimizer_ms * f,
        params=params,
    )


def _step_ms(profile: ModelProfile, cluster: Cluster, config: PredictConfig, n: int) -> float:
    return predict(profile, cluster, replace(config, world_sizes=[n]))[0].step_ms


def calibrated_fabric(
    profile: ModelProfile, cluster: Cluster, config: PredictConfig, run: ScaleRun
) -> Cluster:
    """`cluster` with the link of the largest measured N fitted to its measured step (module doc)."""
    n = max(run.step_ms)
    # the fit predicts N once per bisection step: the one-call bound holds for all of them together
    check_bounds(profile, replace(config, world_sizes=[n]), batches=_BISECT_STEPS + 1)
    hosts = run.hosts[n]
    if hosts > 1:
        cluster = replace(cluster, workers_per_node=n // hosts)
    attr = "inter" if hosts > 1 else "intra"
    base = replace(cluster, measured={})
    target = run.step_ms[n]

    def with_rate(bandwidth: float) -> Cluster:
        link = replace(getattr(base, attr), bandwidth_GBps=bandwidth, efficiency=1.0)
        return replace(base, **{attr: link})

    level = f"{attr}-node link"
    where = f"{run.path}, {run.engine} at N = {n}"
    lo, hi = 1e-3, 1e5  # GB/s
    if _step_ms(profile, with_rate(hi), config, n) >= target:
        return replace(
            base, source=f"{base.source}; {level} kept: the measured step at N = {n} hid its reductions"
        )
    for _ in range(_BISECT_STEPS):
        mid = (lo * hi) ** 0.5
        if _step_ms(profile, with_rate(mid), config, n) > target:
            lo = mid
        else:
            hi = mid
    return replace(
        with_rate((lo * hi) ** 0.5),
        name=f"{cluster.name}, calibrated from a measured run",
        source=f"compute and the {level} fitted to the measured steps of {where}; the rest: {cluster.source}",
    )
