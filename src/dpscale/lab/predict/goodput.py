"""Goodput: time to a training target vs workers and global batch, from throughput and noise scale.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", eq. 2.11): to reach a given
loss, the optimizer steps S and the samples E needed at global batch B follow

    S(B) = S_min (1 + B_noise / B)        E(B) = E_min (1 + B / B_noise),   E_min = S_min B_noise

where B_noise is the noise scale (here the simple estimate B_simple that `dpscale train` measures,
which the paper finds close to the critical batch when the Hessian is well conditioned). One
measured run that reached the target in S_0 steps at batch B_0 fixes S_min = S_0 / (1 + B_noise/B_0).
The throughput model (model.py) gives the step time at N workers and per-worker batch b; the time
to target is then S(N b) x step time, and the worker-time N times that. Large batches need fewer,
longer steps; beyond B_noise each doubling of the batch saves less than half the steps (Pollux,
OSDI 2021, calls throughput x this statistical efficiency "goodput").
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from dpscale.errors import ConfigError
from dpscale.lab.bench.report import text_table


@dataclass(frozen=True)
class NoiseScaleSource:
    """The measured noise scale and, if the source had it, the run's steps and global batch."""

    noise_scale: float
    steps: int | None = None
    global_batch: int | None = None
    source: str = "given"


def load_noise_scale(text: str) -> NoiseScaleSource:
    """A number, a `dpscale train --json` summary (a file whose last line is that JSON object), or a
    metrics.jsonl (or its directory): the last logged `gns`."""
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"--noise-scale: must be a positive number of samples, got {text}")
        return NoiseScaleSource(value)
    path = Path(text)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(
            f"--noise-scale: {text!r} is neither a number nor a file; give B_simple or a run's JSON"
        )
    try:
        gns, steps, batch = _read_noise_scale(path)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        # a file is input: a binary file, strings where numbers go, a list for a record
        reason = " ".join(str(e).split())[:160]
        raise ConfigError(f"--noise-scale: cannot read {text}: {type(e).__name__}: {reason}") from None
    if gns is None or not gns > 0:
        raise ConfigError(
            f"--noise-scale: {text} holds no positive noise scale (the run measured none: one worker "
            "without accumulation, or --no-noise-scale); give the number instead"
        )
    return NoiseScaleSource(float(gns), steps, batch, source=str(path))


def _read_noise_scale(path: Path) -> tuple[float | None, int | None, int | None]:
    """(noise scale, steps, global batch) from a train summary or metrics lines; the types are
    checked: a string where a number goes is a TypeError here, not a crash in the prediction."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    try:
        records = [json.loads(line) for line in lines]
    except json.JSONDecodeError:
        records = [json.loads(lines[-1])] if lines else []  # a log whose last line is the summary
    if records and "gradient_noise_scale" in records[-1]:  # a train summary
        r = records[-1]
        gns, steps, batch = r["gradient_noise_scale"], r.get("steps"), r.get("global_batch")
    else:
        values = [r["gns"] for r in records if r.get("gns") is not None]
        gns = values[-1] if values else None
        steps = records[-1].get("step") if records else None
        batch = None  # metrics lines do not carry the global batch
    for name, value, kinds in (
        ("noise scale", gns, (int, float)),
        ("steps", steps, (int,)),
        ("global_batch", batch, (int,)),
    ):
        if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
            raise TypeError(f"{name} is {value!r}, not a number")
    if gns is not None and not math.isfinite(gns):
        raise ValueError(f"noise scale is {gns}, not a finite number")
    return gns, steps, batch


def steps_to_target(batch: float, *, s_min: float, noise_scale: float) -> float:
    """S(B) = S_min (1 + B_noise / B)."""
    return s_min * (1.0 + noise_scale / batch)


def samples_to_target(batch: float, *, s_min: float, noise_scale: float) -> float:
    """E(B) = E_min (1 + B / B_noise), E_min = S_min B_noise; equals B x S(B)."""
    return s_min * noise_scale * (1.0 + batch / noise_scale)


def s_min_from_run(steps: float, batch: float, noise_scale: float) -> float:
    """The S_min that makes S(batch) equal the measured `steps`."""
    if not (steps > 0 and batch > 0):
        raise ConfigError(f"--target-steps and --target-batch must be > 0, got {steps} and {batch}")
    return steps / (1.0 + noise_scale / batch)


@dataclass(frozen=True)
class GoodputPoint:
    world_size: int
    per_worker_batch: int
    global_batch: int
    step_ms: float
    steps: float  # predicted optimizer steps to the target
    samples: float
    time_s: float
    worker_s: float  # world_size x time_s
    statistical_efficiency: float  # E_min / E(B): the share of samples that a tiny batch would need

    def to_dict(self) -> dict:
        return asdict(self)


def goodput_points(
    step_ms: dict[tuple[int, int], float], *, s_min: float, noise_scale: float
) -> list[GoodputPoint]:
    """One point per (world size, per-worker batch) with a predicted step time, sorted by (N, B)."""
    points = []
    for (n, b), ms in sorted(step_ms.items()):
        batch = n * b
        steps = steps_to_target(batch, s_min=s_min, noise_scale=noise_scale)
        time_s = steps * ms / 1e3
        points.append(
            GoodputPoint(
                world_size=n,
                per_worker_batch=b,
                global_batch=batch,
                step_ms=ms,
                steps=steps,
                samples=steps * batch,
                time_s=time_s,
                worker_s=n * time_s,
                statistical_efficiency=1.0 / (1.0 + batch / noise_scale),
            )
        )
    return points


def fastest(points: list[GoodputPoint]) -> GoodputPoint:
    return min(points, key=lambda p: (p.time_s, p.worker_s))


def cheapest(points: list[GoodputPoint]) -> GoodputPoint:
    return min(points, key=lambda p: (p.worker_s, p.time_s))


_HEADERS = {
    "world_size": "N",
    "per_worker_batch": "b/worker",
    "global_batch": "global B",
    "step_ms": "step ms",
    "steps": "steps",
    "statistical_efficiency": "stat eff",
    "time_s": "time s",
    "worker_s": "worker-s",
    "note": "",
}
_FORMATS = {
    "step_ms": lambda v: f"{v:.2f}",
    "steps": lambda v: f"{v:.0f}",
    "statistical_efficiency": lambda v: f"{v:.2f}",
    "time_s": lambda v: f"{v:.4g}",
    "worker_s": lambda v: f"{v:.4g}",
}


def format_table(points: list[GoodputPoint]) -> str:
    """The plan as a terminal table (bench/report.py's one renderer), the two best rows marked."""
    best, low = fastest(points), cheapest(points)
    rows = []
    for p in points:
        marks = ["<- soonest"] * (p is best) + ["<- least worker-time"] * (p is low)
        rows.append({**p.to_dict(), "note": " ".join(marks)})
    return text_table(rows, list(_HEADERS), _FORMATS, _HEADERS)


def summary(points: list[GoodputPoint], noise_scale: float, s_min: float) -> str:
    best, low = fastest(points), cheapest(points)
    return (
        f"noise scale B_noise {noise_scale:,.0f} samples, S_min {s_min:,.0f} steps, "
        f"E_min {s_min * noise_scale:,.0f} samples\n"
        f"soonest: N={best.world_size} x {best.per_worker_batch} (global batch {best.global_batch}): "
        f"{best.time_s:.4g} s, {best.worker_s:.4g} worker-s\n"
        f"least worker-time: N={low.world_size} x {low.per_worker_batch} (global batch {low.global_batch}): "
        f"{low.time_s:.4g} s, {low.worker_s:.4g} worker-s"
    )
