"""`dpscale train --trace`: the Trainer's steps as a Chrome trace (train/step_trace.py), checked
against what the engine measured; without --trace the loop marks nothing."""

import json

import pytest
import torch.distributed as dist

from dpscale.engine.telemetry import PHASES
from dpscale.engine.trace import BUCKET_TID0, PHASE_NAMES, PHASE_TID, STEP_TID
from dpscale.errors import ConfigError
from dpscale.train.config import TrainConfig
from dpscale.train.trainer import Trainer


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
