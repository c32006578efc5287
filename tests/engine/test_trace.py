"""Chrome traces from step records (engine/trace.py), and the telemetry that stamps them: the
ranges agree with the engine's own stats, the window bounds what is kept, and files go through
the no-follow writer."""

import json
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dpscale.engine.telemetry import PHASES, TelemetryDDP
from dpscale.engine.trace import (
    BUCKET_TID0,
    IDLE_TID,
    PHASE_NAMES,
    PHASE_TID,
    STEP_TID,
    TraceWindow,
    idle_by_rank,
    rank_trace,
    trace_window,
    write_traces,
)
from dpscale.errors import ConfigError


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("text", ["5", "a:b", "5:5", "0:3", "9:2", ":4", "3:", "-1:2", "1:200002"])
def test_a_bad_window_is_one_line_naming_the_flag(text):
    with pytest.raises(ConfigError, match="--trace-steps") as e:
        TraceWindow.parse(text)
    assert "\n" not in str(e.value)


def test_the_window_defaults_with_trace_and_needs_it():
    assert trace_window("out", None) == TraceWindow(10, 20)
    assert (
        trace_window("out", "3:5") == TraceWindow(3, 5)
        and 4 in TraceWindow(3, 5)
        and 5 not in TraceWindow(3, 5)
    )
    assert trace_window(None, None) is None
    with pytest.raises(ConfigError, match="--trace-steps needs --trace"):
        trace_window(None, "3:5")


def _record(step, start_s, step_ms, buckets=2):
    parts = [0.5, 2.0, 3.0, 1.0, 1.5, 2.0]  # ms, PHASES order
    scale = step_ms / sum(parts)
    return {
        "step": step,
        "start_s": start_s,
        "step_ms": step_ms,
        "samples": 16,
        "micro_steps": 2,
        "phases": dict(zip(PHASES, (p * scale for p in parts), strict=True)),
        "buckets": [
            {"index": i, "nbytes": 1024 * (i + 1), "start_ms": 4.0 + i, "end_ms": 6.0 + i}
            for i in range(buckets)
        ],
    }


def _doc(rank, step_ms):
    records = [{"step_ms": 1.0, "samples": 1, "micro_steps": 1}]  # a step outside the window: no start
    records += [_record(k, 100.0 + k * 0.02 + rank * 1e-4, ms) for k, ms in zip((3, 4), step_ms, strict=True)]
    return {"rank": rank, "world_size": 2, "transport": "gloo", "records": records}


def _x(trace, tid):
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == tid]


def test_a_rank_trace_holds_steps_phases_buckets_and_idle_with_rank_and_step():
    docs = [_doc(0, [10.0, 12.0]), _doc(1, [11.0, 11.0])]
    idle = idle_by_rank(docs)
    assert idle == {0: {3: pytest.approx(1.0), 4: 0.0}, 1: {3: 0.0, 4: pytest.approx(1.0)}}
    trace = json.loads(json.dumps(rank_trace(docs[0], idle[0], TraceWindow(3, 5))))
    steps, phases, idles = _x(trace, STEP_TID), _x(trace, PHASE_TID), _x(trace, IDLE_TID)
    assert [(e["args"]["rank"], e["args"]["step"]) for e in steps] == [(0, 3), (0, 4)]
    assert [e["dur"] for e in steps] == pytest.approx([10e3, 12e3])
    for step in steps:  # the phases tile the step, in time order
        mine = [e for e in phases if e["args"]["step"] == step["args"]["step"]]
        assert [e["name"] for e in mine] == [PHASE_NAMES[p] for p in PHASES]
        assert sum(e["dur"] for e in mine) == pytest.approx(step["dur"])
        assert mine[0]["ts"] == step["ts"]
        for a, b in zip(mine, mine[1:], strict=False):
            assert b["ts"] == pytest.approx(a["ts"] + a["dur"])
    assert [(e["args"]["step"], e["dur"]) for e in idles] == [(3, pytest.approx(1e3))]
    buckets = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] >= BUCKET_TID0]
    assert len(buckets) == 4 and {e["args"]["bytes"] for e in buckets} == {1024, 2048}
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names[BUCKET_TID0 + 1] == "bucket 1 reduction" and names[PHASE_TID] == "phases"
    (process,) = [e for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert process["args"]["name"] == "rank 0" and trace["distributedInfo"]["rank"] == 0
    assert trace["dpscale"]["steps"] == [3, 4] and trace["dpscale"]["window"] == "3:5"


def test_traces_are_written_per_rank_and_never_through_a_planted_link(tmp_path):
    docs = [_doc(1, [10.0, 12.0]), _doc(0, [11.0, 11.0])]
    paths = write_traces(tmp_path / "t", docs)
    assert [p.name for p in paths] == ["rank0.trace.json", "rank1.trace.json"]
    assert json.loads(paths[1].read_text())["distributedInfo"]["rank"] == 1
    victim = tmp_path / "victim"
    victim.write_text("keep")
    os.unlink(paths[0])
    os.symlink(victim, paths[0])
    with pytest.raises(ConfigError, match="symbolic link"):
        write_traces(tmp_path / "t", docs)
    assert victim.read_text() == "keep"


def _train(model, steps, *, marks=True):
    """Steps as `dpscale run` sees them: the script's backward and optimizer marked (script_watch)."""
    import time

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 16)
    stats = []
    for _ in range(steps):
        loss = model(x).square().mean()
        b0 = time.perf_counter()
        loss.backward()
        if marks:
            model.telemetry.marks.backward = (b0, time.perf_counter())
        stats.append(model.last_step_stats)
        opt.step()
        if marks:
            model.telemetry.marks.optimizer_end = time.perf_counter()
            model.telemetry.marks.optimizer_steps += 1
        opt.zero_grad()
    return stats


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))


def test_the_engines_records_in_the_window_agree_with_its_stats(world_of_one):
    model = TelemetryDDP(_net(), bucket_cap_mb=0.1, first_bucket_cap_mb=0.1)
    model.telemetry.trace = TraceWindow(3, 6)
    stats = _train(model, 8)
    records = model.telemetry.to_dict()["records"]
    assert len(records) == 7  # the 8th step ends at a forward that never came
    traced = [r for r in records if r.get("start_s") is not None]
    assert [r["step"] for r in traced] == [3, 4, 5]
    trace = rank_trace({"rank": 0, "world_size": 1, "records": records})
    for r in traced:
        engine = stats[r["step"] - 1]  # the step's own StepStats
        assert len(engine.buckets) >= 2 and len(r["buckets"]) == len(engine.buckets)
        for mine, its in zip(r["buckets"], engine.buckets, strict=True):
            assert mine["index"] == its.index and mine["nbytes"] == its.nbytes
            assert mine["end_ms"] - mine["start_ms"] == pytest.approx(its.end_ms - its.start_ms, abs=1e-6)
            assert 0 <= mine["start_ms"] <= mine["end_ms"] <= r["step_ms"]
        assert sum(r["phases"].values()) == pytest.approx(r["step_ms"], rel=0.05)
        assert r["phases"]["exposed_comm_ms"] == pytest.approx(engine.exposed_comm_ms, abs=1e-6)
        step = [e for e in _x(trace, STEP_TID) if e["args"]["step"] == r["step"]]
        bucket_events = [e for e in trace["traceEvents"] if e.get("tid", 0) >= BUCKET_TID0 and e["ph"] == "X"]
        assert len([e for e in bucket_events if e["args"]["step"] == r["step"]]) == len(engine.buckets)
        assert step[0]["dur"] == pytest.approx(r["step_ms"] * 1e3)


def test_with_trace_only_a_run_keeps_the_windows_records_alone(world_of_one):
    model = TelemetryDDP(_net(), bucket_cap_mb=0.1)
    model.telemetry.trace, model.telemetry.trace_only = TraceWindow(2, 4), True
    _train(model, 9, marks=False)
    doc = model.telemetry.to_dict()
    assert [r["step"] for r in doc["records"]] == [2, 3] and doc["forward_ms"] == []


def test_without_a_window_no_record_carries_trace_fields(world_of_one):
    model = TelemetryDDP(_net())
    _train(model, 4, marks=False)
    assert all(r["start_s"] is None and r["buckets"] is None for r in model.telemetry.to_dict()["records"])
