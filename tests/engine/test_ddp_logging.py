"""`_get_ddp_logging_data()` on a GPU: its times come from the engine's clock, read late.

On CUDA the host only enqueues work, so the forward, backward and communication times torch's
logging data reports must be CUDA-event times, read once the events completed (a step or more
later), never by waiting. Fake events (support/fake_events.py) play the device on CPU: each
records a time the test knows, and a wait or a read before completion fails the test.
"""

import itertools

import pytest
import torch
from torch import nn

from dpscale import DistributedDataParallel
from dpscale.engine.clock import EventClock
from dpscale.engine.observers import StepObserver
from support.echo_group import EchoGroup
from support.fake_events import FakeDevice

NS = 1e6  # per ms


class Seen(StepObserver):
    def __init__(self):
        self.steps = []

    def on_step(self, stats, norms):
        self.steps.append(stats)


def _engine(device):
    torch.manual_seed(0)
    ddp = DistributedDataParallel(
        nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)),
        process_group=EchoGroup(2),
        init_sync=False,
        bucket_cap_mb=1e-4,  # a few buckets
        first_bucket_cap_mb=1e-4,
    )
    ddp.set_noise_scale_observer(None)
    ddp.reducer.clock = EventClock(device.event)
    seen = Seen()
    ddp.add_step_observer(seen)
    return ddp, seen


def _step(ddp, device, seed):
    """One synced step; returns the forward's two events (the first two it records)."""
    torch.manual_seed(seed)
    n = len(device.recorded)
    out = ddp(torch.randn(3, 4))
    start, end = device.recorded[n : n + 2]
    out.sum().backward()
    return start, end


def test_logging_data_times_are_the_engines_events_read_late_without_a_sync():
    device = FakeDevice(0.5 * k * k for k in itertools.count())  # increasing, uneven gaps
    ddp, seen = _engine(device)
    forwards = [_step(ddp, device, seed) for seed in (1, 2, 3)]
    # the device has run nothing: no time is known yet, and none is waited for
    data = ddp._get_ddp_logging_data()
    assert "forward_compute_time" not in data and "backward_compute_time" not in data
    assert seen.steps == []
    device.run_until()
    forwards.append(_step(ddp, device, 4))  # steps 1-3 are read at this step's start, 4 at its end
    data = ddp._get_ddp_logging_data()
    forward_ns = [int((end.ms - start.ms) * NS) for start, end in forwards]
    assert data["forward_compute_time"] == forward_ns[-1] > 0
    assert data["avg_forward_compute_time"] == sum(forward_ns) // 4
    # every sampled step arrived, the late ones too, with the engine's own stats
    assert [s.step for s in seen.steps] == [1, 2, 3, 4] and data["iteration"] == 3
    last = seen.steps[-1]
    assert data["backward_compute_time"] == int(last.backward_ms * NS)
    assert data["backward_comm_time"] == int(last.comm_ms * NS) > 0
    avg = sum(s.comm_ms for s in seen.steps) * NS / 4
    assert data["avg_backward_comm_time"] == pytest.approx(int(avg), abs=1)
    assert data["backward_compute_time_end"] == ddp.reducer.last_backward_end_epoch_ns
    ddp.close()


def test_a_step_sampled_before_a_resume_is_named_by_the_reducers_step_count():
    # a resumed run counts synced steps from its position: the sampled forward's backward is
    # the reducer's next step, whatever the forward count says
    device = FakeDevice(itertools.count())
    device.run_until()
    ddp, seen = _engine(device)
    ddp.reducer.set_synced_steps(40)
    for seed in (1, 2):
        _step(ddp, device, seed)
    data = ddp._get_ddp_logging_data()
    assert [s.step for s in seen.steps] == [41, 42]
    assert data["backward_comm_time"] == int(seen.steps[-1].comm_ms * NS)
    ddp.close()
