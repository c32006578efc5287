"""`dpscale train --trace`: the Trainer's steps as a Chrome trace (train/step_trace.py), checked
against what the engine measured; without --trace the loop marks nothing."""

import json
import subprocess
import sys

import pytest
import torch.distributed as dist

from dpscale.engine.telemetry import PHASES
from dpscale.engine.trace import BUCKET_TID0, PHASE_NAMES, PHASE_TID, STEP_TID
from dpscale.errors import ConfigError
from dpscale.train.config import TrainConfig
from dpscale.train.trainer import Trainer
from dpscale.workloads.models import DigitsNet


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_trained_runs_trace_holds_the_window_with_phases_adding_up_and_every_bucket(world_of_one, tmp_path):
    cfg = TrainConfig.from_flat(
        workload="synthetic",
        max_steps=9,
        progress="none",
        accumulation_steps=2,
        bucket_cap_mb=0.01,
        trace=str(tmp_path / "t"),
        trace_steps="3:7",
    )
    trainer = Trainer(cfg)
    trainer.fit()
    trace = json.loads((tmp_path / "t" / "rank0.trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    steps = [e for e in events if e["tid"] == STEP_TID]
    assert [e["args"]["step"] for e in steps] == [3, 4, 5, 6] and trace["dpscale"]["window"] == "3:7"
    assert {e["args"]["micro_steps"] for e in steps} == {2}
    buckets = len(trainer.model.reducer.buckets)
    assert buckets >= 2
    for step in steps:
        k = step["args"]["step"]
        phases = [e for e in events if e["tid"] == PHASE_TID and e["args"]["step"] == k]
        assert [e["name"] for e in phases] == [PHASE_NAMES[p] for p in PHASES]
        assert sum(e["dur"] for e in phases) == pytest.approx(step["dur"], rel=0.05)
        reductions = [e for e in events if e["tid"] >= BUCKET_TID0 and e["args"]["step"] == k]
        assert len(reductions) == buckets
        assert all(
            step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] for e in reductions
        )


def test_without_trace_the_loop_keeps_no_marks(world_of_one):
    trainer = Trainer(TrainConfig.from_flat(workload="synthetic", max_steps=2, progress="none"))
    assert trainer._trace is None


def test_trace_steps_without_trace_is_refused():
    with pytest.raises(ConfigError, match="--trace-steps needs --trace"):
        TrainConfig.from_flat(workload="synthetic", trace_steps="1:3")


def test_under_a_torch_profiler_the_loops_phases_show_as_ranges(world_of_one):
    import torch

    from dpscale.engine.profiler_ranges import DATA_WAIT, FORWARD, OPTIMIZER, bucket_range_name

    trainer = Trainer(TrainConfig.from_flat(workload="synthetic", max_steps=3, progress="none"))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        trainer.fit()
    names = {e.name for e in prof.events()}
    assert {DATA_WAIT, OPTIMIZER, FORWARD, bucket_range_name(0)} <= names


def _lane(trace: dict, first_tid: int, last_tid: int | None = None) -> dict[int, list[dict]]:
    """The trace's ranges on lanes first_tid..last_tid (every lane from first_tid without one), by step."""
    out: dict[int, list[dict]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and first_tid <= e["tid"] <= (last_tid or e["tid"]):
            out.setdefault(e["args"]["step"], []).append(e)
    return out


@pytest.mark.slow
def test_train_on_two_workers_writes_traces_that_agree_with_the_engines_stats_and_each_other(tmp_path):
    cmd = [
        "train",
        "--nproc",
        "2",
        "--workload",
        "synthetic",
        "--max-steps",
        "9",
        "--accumulation-steps",
        "2",
    ]
    cmd += ["--bucket-cap-mb", "0.01", "--trace", "t", "--trace-steps", "3:8", "--metrics-dir", "m"]
    p = subprocess.run(
        [sys.executable, "-m", "dpscale.cli.main", *cmd],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    lines = (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()
    metrics = {m["step"]: m for m in map(json.loads, lines)}  # rank 0's, from the engine's StepStats
    traces = [json.loads((tmp_path / "t" / f"rank{r}.trace.json").read_text()) for r in range(2)]
    grad_bytes = sum(p.numel() * p.element_size() for p in DigitsNet().parameters())
    window = [3, 4, 5, 6, 7]
    steps = [{k: es[0] for k, es in _lane(t, STEP_TID, STEP_TID).items()} for t in traces]
    buckets = [_lane(t, BUCKET_TID0) for t in traces]
    for rank, trace in enumerate(traces):
        assert trace["distributedInfo"]["rank"] == rank and trace["distributedInfo"]["world_size"] == 2
        assert sorted(steps[rank]) == window == trace["dpscale"]["steps"]
        phases = _lane(trace, PHASE_TID, PHASE_TID)
        for k, step in steps[rank].items():
            assert step["args"]["micro_steps"] == 2 and step["args"]["samples"] == 64  # 128 over 2 ranks
            assert [e["name"] for e in phases[k]] == [PHASE_NAMES[p] for p in PHASES]
            assert sum(e["dur"] for e in phases[k]) == pytest.approx(step["dur"], rel=0.05)
            # every gradient byte reduced once, in the several buckets a 0.01 MB cap makes
            assert (
                len(buckets[rank][k]) >= 2 and sum(e["args"]["bytes"] for e in buckets[rank][k]) == grad_bytes
            )
            end = step["ts"] + step["dur"]
            assert all(step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= end for e in buckets[rank][k])
            if rank == 0:  # the exposed communication is the engine's figure, within its backward
                phase = {e["name"]: e["dur"] for e in phases[k]}
                exposed, backward = phase[PHASE_NAMES["exposed_comm_ms"]], phase[PHASE_NAMES["backward_ms"]]
                assert exposed == pytest.approx(
                    min(metrics[k]["exposed_comm_ms"] * 1e3, exposed + backward), abs=1
                )
    for k in window:
        # one host clock for both files: a bucket's all-reduce ends on neither rank before both launched it
        pairs = zip(*(sorted(b[k], key=lambda e: e["tid"]) for b in buckets), strict=True)
        assert all(b0["ts"] <= b1["ts"] + b1["dur"] and b1["ts"] <= b0["ts"] + b0["dur"] for b0, b1 in pairs)
        # the idle lane: each rank's step plus its wait behind the slowest rank is the slowest's step
        idle_ms = [s[k]["args"]["idle_ms"] for s in steps]
        assert min(idle_ms) == 0
        waited = [s[k]["dur"] + idle * 1e3 for s, idle in zip(steps, idle_ms, strict=True)]
        assert waited[0] == pytest.approx(waited[1], abs=1)
