"""Canned rank records for `dpscale scale`'s figures (engine/telemetry.py StepRecord as dicts), and
`measure` over them with no process started."""

from __future__ import annotations

from pathlib import Path

from dpscale.engine.telemetry import PHASES
from dpscale.lab.bench import script_scaling
from dpscale.lab.bench.script_scaling import ScaleConfig
from dpscale.lab.predict.compression_cost import CompressionCost


def step(phases: dict, *, samples: int, optimizer_steps: int = 1, micro_steps: int = 1, **extra) -> dict:
    full = dict.fromkeys(PHASES, 0.0) | phases
    return {
        "step_ms": sum(full.values()),
        "samples": samples,
        "micro_steps": micro_steps,
        "exposed_comm_ms": full["exposed_comm_ms"],
        "backward_ms": full["backward_ms"],
        "phases": full,
        "optimizer_steps": optimizer_steps,
        "forward_total_ms": full["forward_ms"],
        "backward_total_ms": full["backward_ms"] + full["exposed_comm_ms"],
        **extra,
    }


def rank(
    records: list[dict], rank: int = 0, world: int = 1, ddp: bool = True, script: dict | None = None
) -> dict:
    return {
        "rank": rank,
        "world_size": world,
        "ddp": ddp,
        "transport": "shm" if ddp else "none",
        "host": "h",
        "param_count": 10,
        "param_bytes": 40,
        "forward_ms": [],
        "records": records,
        "script": script,
    }


FREE_CASTS = CompressionCost(
    cast_in_ms_per_mb=0.0,
    divide_ms_per_mb=0.0,
    stage_ms_per_mb=0.0,
    cast_out_ms_per_mb=0.0,
    add16_ms_per_mb=0.0,
    add32_ms_per_mb=0.0,
)


def measure(
    monkeypatch,
    runs: dict[int, list[dict]],
    steps: int,
    casts: CompressionCost = FREE_CASTS,
    **config,
) -> script_scaling.ScaleResult:
    """`measure` over canned rank records (no process starts); with `tries`, `runs[("try", FIX)]`
    are the ranks of each fix's rerun. `casts` stands for this host's measured fp16 cast rates
    (free by default: the figures then do not depend on the host)."""

    def one(config, n, engine, logs, job, try_fix=None):
        return runs[n] if try_fix is None else runs[("try", try_fix)]  # type: ignore[index]

    monkeypatch.setattr(script_scaling, "_measure_one", one)
    monkeypatch.setattr(script_scaling.compression_cost, "measure", lambda threads: casts)
    sizes = sorted(k for k in runs if isinstance(k, int))
    config = {"warmup": 0, **config}
    cfg = ScaleConfig(script="train.py", world_sizes=sizes, steps=steps, threads_per_worker=1, **config)
    return script_scaling.measure(cfg, Path("."))
