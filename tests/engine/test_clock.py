"""The engine's clock: CUDA-event timings checked on CPU with events whose times the test sets.

The event clock must give the same `backward_ms`, `comm_ms` and `exposed_comm_ms` as host time
for the same moments, and a step whose events have not completed must be reported later, in
order, never dropped and never waited for.
"""

import itertools

import pytest
import torch
from torch import nn

from dpscale import DistributedDataParallel
from dpscale.engine.clock import EventClock, HostClock, clock_for
from dpscale.engine.observers import StepObserver
from dpscale.engine.stats import BucketTiming, StepStats, StepWindow
from support.echo_group import EchoGroup
from support.fake_events import FakeDevice


def _flat(stats):
    """The stats' timings in one flat list (pytest.approx compares no nested dicts)."""
    d = stats.to_dict()
    buckets = [v for b in d["buckets"] for v in b.values()]
    return [d[k] for k in ("step", "backward_ms", "comm_ms", "exposed_comm_ms")] + buckets


def _window(stamp, blocking_ms=0.0):
    timings = [
        BucketTiming(0, 100, start=stamp(2.0), end=stamp(5.0), blocking_ms=blocking_ms),
        BucketTiming(1, 100, start=stamp(4.0), end=stamp(9.0), blocking_ms=blocking_ms),
        BucketTiming(2, 100, start=stamp(10.0), end=None),  # completion seen only at the wait
    ]
    return StepWindow(1, stamp(0.0), stamp(8.0), stamp(12.0), timings)


def test_events_and_host_time_give_the_same_step_stats():
    device = FakeDevice(itertools.count())
    events = EventClock(device.event)

    def event_at(ms):
        e = device.event()
        e.record()
        e.ms = ms
        return e

    by_events = _window(event_at)
    assert not by_events.ready(events)  # nothing has run yet
    device.run_until(11.0)
    assert not by_events.ready(events)  # the step's last event (12 ms) has not
    device.run_until()
    assert by_events.ready(events)
    got = StepStats.from_window(by_events, events)
    host = StepStats.from_window(_window(lambda ms: ms / 1e3), HostClock())
    assert _flat(got) == pytest.approx(_flat(host))
    # backward until 8, reductions in flight over [2, 9] and [10, 12], waited on from 8 to 12
    assert (got.backward_ms, got.comm_ms, got.exposed_comm_ms) == pytest.approx((8.0, 9.0, 4.0))
    assert [b.end_ms for b in got.buckets] == pytest.approx([5.0, 9.0, 12.0])


def test_blocking_launches_count_as_held_up_compute():
    stats = StepStats.from_window(_window(lambda ms: ms / 1e3, blocking_ms=1.0), HostClock())
    # the two launches before the end of backward held it up 1 ms each
    assert (stats.backward_ms, stats.exposed_comm_ms) == pytest.approx((6.0, 6.0))


class Seen(StepObserver):
    wants_reduced_norm = True

    def __init__(self):
        self.steps, self.norms = [], []

    def wants_grad_norms(self, step):
        return True

    def on_step(self, stats, norms):
        self.steps.append(stats)
        self.norms.append(norms)


def _engine(clock):
    torch.manual_seed(0)
    ddp = DistributedDataParallel(
        nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)),
        process_group=EchoGroup(2),
        init_sync=False,
        bucket_cap_mb=1e-4,  # a few buckets
        first_bucket_cap_mb=1e-4,
    )
    ddp.set_noise_scale_observer(None)
    ddp.reducer.clock = clock
    seen = Seen()
    ddp.add_step_observer(seen)
    return ddp, seen


def _step(ddp, seed):
    torch.manual_seed(seed)
    ddp(torch.randn(3, 4)).sum().backward()


def _as_host_time(window):
    """The same window with each fake event replaced by its time as a host stamp (seconds)."""
    at = lambda e: None if e is None else e.ms / 1e3
    timings = [BucketTiming(t.index, t.nbytes, at(t.start), at(t.end), t.blocking_ms) for t in window.timings]
    return StepWindow(window.step, at(window.forward_end), at(window.backward_end), at(window.done), timings)


def test_the_engine_times_a_step_alike_with_events_and_host_time(monkeypatch):
    windows = []
    from_window = StepStats.from_window.__func__

    def spy(cls, window, clock):
        windows.append(window)
        return from_window(cls, window, clock)

    monkeypatch.setattr(StepStats, "from_window", classmethod(spy))
    device = FakeDevice(0.5 * k * k for k in itertools.count())  # increasing, uneven gaps
    ddp, seen = _engine(EventClock(device.event))
    device.run_until()
    for seed in (1, 2):
        _step(ddp, seed)
    assert [s.step for s in seen.steps] == [1, 2]
    for window, stats in zip(list(windows), seen.steps, strict=True):
        assert len(window.timings) >= 2
        # each reduction's end is an event of its own (recorded behind the collective), and the
        # launch holds up no compute on a device
        assert all(t.end is not None and t.blocking_ms == 0.0 for t in window.timings)
        host = StepStats.from_window(_as_host_time(window), HostClock())
        assert _flat(stats) == pytest.approx(_flat(host))
        assert stats.comm_ms > 0 and stats.backward_ms > 0
    ddp.close()


def test_a_step_whose_events_are_incomplete_is_reported_later_in_order_without_a_sync():
    device = FakeDevice(itertools.count())
    ddp, seen = _engine(EventClock(device.event))
    _step(ddp, 1)
    # the device has not run the step: nothing reported, nothing waited for
    assert seen.steps == [] and ddp.last_step_stats is None
    first_step_events = len(device.recorded)
    _step(ddp, 2)
    assert seen.steps == []
    device.run_until(device.recorded[first_step_events - 1].ms)  # step 1 done, step 2 not
    _step(ddp, 3)  # read at the next step's start
    assert [s.step for s in seen.steps] == [1]
    device.run_until()
    _step(ddp, 4)
    assert [s.step for s in seen.steps] == [1, 2, 3, 4]
    assert ddp.last_step_stats.step == 4
    assert all(n is not None and n.local_sq > 0 for n in seen.norms)
    ddp.close()


def test_the_clock_follows_the_device():
    assert isinstance(clock_for("cpu"), HostClock) and isinstance(clock_for(None), HostClock)
    assert isinstance(clock_for(torch.device("cuda", 0)), EventClock)
