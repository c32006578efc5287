"""Chrome-trace files of the steps a rank ran: `--trace DIR` on `dpscale scale`, `run` and `train`.

The format is the one torch.profiler exports and Perfetto (ui.perfetto.dev) and chrome://tracing
open: {"traceEvents": [...]} of "X" complete events (ts and dur in microseconds) on pid/tid lanes,
and "M" metadata events naming them. Each rank's file is built from its step records
(telemetry.StepRecord as dicts), after the run: nothing is written while the script trains.

Lanes, one process per rank (pid = rank): the steps (each an "X" event whose args carry the rank,
the step, its samples and the idle time behind the slowest rank), the phases (telemetry.PHASES in
time order, adding up to the step), the idle time at the step's end (waiting for the slowest
rank's step, when every rank's records are at hand), and one lane per bucket with its reduction
from launch to completion. Times are the host's monotonic clock (time.perf_counter), one clock for
every process of a host: the ranks' files of one host line up when opened together.

Only a window of steps is kept (`TraceWindow`, `--trace-steps A:B`): a trace of a long run stays
small, and a step outside the window costs nothing beyond the check.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dpscale.errors import ConfigError
from dpscale.paths import write_no_follow

DEFAULT_STEPS = "10:20"
# one process per rank; lanes (tids) in the order Perfetto lists them
STEP_TID, PHASE_TID, IDLE_TID, BUCKET_TID0 = 1, 2, 3, 10
PHASE_NAMES = {
    "micro_steps_ms": "accumulation micro-steps",
    "forward_ms": "forward",
    "backward_ms": "backward",
    "exposed_comm_ms": "exposed communication",
    "optimizer_ms": "optimizer",
    "data_wait_ms": "data wait",
}
MAX_STEPS = 100_000  # a window wider than this would write files no viewer opens comfortably


@dataclass(frozen=True)
class TraceWindow:
    """Synchronized steps `start` <= step < `stop`, counted from 1 (the first synced step)."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 1 <= self.start < self.stop:
            raise ConfigError(
                f"--trace-steps {self.start}:{self.stop}: give A:B with 1 <= A < B "
                "(steps A to B-1, counted from 1)"
            )
        if self.stop - self.start > MAX_STEPS:
            raise ConfigError(f"--trace-steps {self.start}:{self.stop}: at most {MAX_STEPS} steps; narrow it")

    def __contains__(self, step: int) -> bool:
        return self.start <= step < self.stop

    def __str__(self) -> str:
        return f"{self.start}:{self.stop}"

    @classmethod
    def parse(cls, text: str) -> TraceWindow:
        """`A:B` (steps A to B-1); ConfigError naming --trace-steps otherwise."""
        start, sep, stop = text.partition(":")
        try:
            if not sep:
                raise ValueError
            return cls(int(start), int(stop))
        except ValueError:
            raise ConfigError(
                f"--trace-steps {text!r}: give A:B, two step numbers with 1 <= A < B, e.g. {DEFAULT_STEPS}"
            ) from None


def trace_window(trace_dir: str | None, trace_steps: str | None) -> TraceWindow | None:
    """The window of `--trace DIR --trace-steps A:B` (DEFAULT_STEPS without --trace-steps); None
    without --trace. --trace-steps alone is refused: it would trace nothing."""
    if trace_dir is None:
        if trace_steps is not None:
            raise ConfigError("--trace-steps needs --trace DIR (where the traces go)")
        return None
    return TraceWindow.parse(trace_steps or DEFAULT_STEPS)


def _meta(pid: int, tid: int | None, name: str, value: str | int) -> dict:
    event: dict = {
        "ph": "M",
        "pid": pid,
        "name": name,
        "args": {"name" if name.endswith("name") else "sort_index": value},
    }
    if tid is not None:
        event["tid"] = tid
    return event


def _x(name: str, pid: int, tid: int, ts_us: float, dur_us: float, cat: str, args: dict) -> dict:
    return {
        "ph": "X",
        "name": name,
        "cat": cat,
        "pid": pid,
        "tid": tid,
        "ts": ts_us,
        "dur": max(0.0, dur_us),
        "args": args,
    }


def _step_events(record: dict, rank: int, idle_ms: float | None) -> list[dict]:
    step, t0 = record["step"], record["start_s"] * 1e6
    where = {"rank": rank, "step": step}
    args = {
        **where,
        "samples": record["samples"],
        "micro_steps": record["micro_steps"],
        "optimizer_steps": record.get("optimizer_steps", 0),
        "evaluations": record.get("evaluations", 0),
        "checkpoints": record.get("checkpoints", 0),
        "idle_ms": idle_ms,
    }
    events = [_x(f"step {step}", rank, STEP_TID, t0, record["step_ms"] * 1e3, "step", args)]
    cursor = t0
    for key, ms in (record.get("phases") or {}).items():
        events.append(_x(PHASE_NAMES.get(key, key), rank, PHASE_TID, cursor, ms * 1e3, "phase", where))
        cursor += ms * 1e3
    if idle_ms:
        end = t0 + record["step_ms"] * 1e3
        events.append(_x("idle (slowest rank)", rank, IDLE_TID, end, idle_ms * 1e3, "phase", where))
    for b in record.get("buckets") or []:
        events.append(
            _x(
                f"bucket {b['index']} reduction",
                rank,
                BUCKET_TID0 + b["index"],
                t0 + b["start_ms"] * 1e3,
                (b["end_ms"] - b["start_ms"]) * 1e3,
                "bucket",
                {**where, "bucket": b["index"], "bytes": b["nbytes"]},
            )
        )
    return events


def traced(records: Sequence[dict]) -> list[dict]:
    """The records a trace holds: those stamped for it (telemetry's `start_s`, inside the window)."""
    return [r for r in records if r.get("start_s") is not None and r.get("step") is not None]


def rank_trace(doc: dict, idle_ms: dict[int, float] | None = None, window: TraceWindow | None = None) -> dict:
    """One rank's Chrome trace from its telemetry document (run_child's rank<r>.json: "rank",
    "world_size", "records"); `idle_ms` maps a step to this rank's wait for the slowest rank."""
    rank, records = doc["rank"], traced(doc["records"])
    buckets = sorted({b["index"] for r in records for b in r.get("buckets") or []})
    events = [
        _meta(rank, None, "process_name", f"rank {rank}"),
        _meta(rank, None, "process_sort_index", rank),
        _meta(rank, STEP_TID, "thread_name", "steps"),
        _meta(rank, PHASE_TID, "thread_name", "phases"),
        _meta(rank, IDLE_TID, "thread_name", "idle (behind the slowest rank)"),
        *(_meta(rank, BUCKET_TID0 + i, "thread_name", f"bucket {i} reduction") for i in buckets),
    ]
    for record in records:
        events += _step_events(record, rank, (idle_ms or {}).get(record["step"]))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        # as torch.profiler's export names the rank, for tools that read a folder of rank traces (HTA)
        "distributedInfo": {"rank": rank, "world_size": doc["world_size"], "backend": doc.get("transport")},
        "dpscale": {
            "rank": rank,
            "world_size": doc["world_size"],
            "steps": [r["step"] for r in records],
            "window": str(window) if window is not None else None,
            "clock": "host perf_counter, microseconds",
        },
    }


def idle_by_rank(docs: Sequence[dict]) -> dict[int, dict[int, float]]:
    """Per rank, per traced step every rank recorded: the slowest rank's step time less its own."""
    steps = [{r["step"]: r["step_ms"] for r in traced(d["records"])} for d in docs]
    common = set.intersection(*(set(s) for s in steps)) if steps else set()
    slowest = {k: max(s[k] for s in steps) for k in common}
    return {d["rank"]: {k: slowest[k] - s[k] for k in common} for d, s in zip(docs, steps, strict=True)}


def write_traces(
    directory: str | os.PathLike[str], docs: Sequence[dict], window: TraceWindow | None = None
) -> list[Path]:
    """rank<r>.trace.json in `directory` (made if need be) for each rank's telemetry document;
    files are written without following a symbolic link planted in their place (paths.py)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    idle = idle_by_rank(docs)
    paths = []
    for doc in sorted(docs, key=lambda d: d["rank"]):
        path = out / f"rank{doc['rank']}.trace.json"
        write_no_follow(path, json.dumps(rank_trace(doc, idle.get(doc["rank"]), window)))
        paths.append(path)
    return paths
