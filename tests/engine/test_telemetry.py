"""Step telemetry on the engine's clock: CUDA events (fake ones here) read once complete.

The limit counts steps as they run, so every rank stops at the same step whatever its device has
finished; records wait for their events and are all read when the telemetry is written.
"""

import pytest
import torch

from dpscale.engine.clock import EventClock
from dpscale.engine.telemetry import Span, StepTelemetry
from support.fake_events import FakeDevice


def test_records_wait_for_their_events_and_the_limit_counts_steps_as_they_run():
    device = FakeDevice([0.0, 7.0, 10.0, 4.0, 9.5, 25.0])
    fired = []
    telemetry = StepTelemetry(
        limit=2, on_limit=lambda t: fired.append(t.steps), clock=EventClock(device.event)
    )
    x = torch.zeros(4, 3)
    no_comm = lambda: (None, None)
    for _ in range(3):
        telemetry.on_forward((x,), {}, True, no_comm)
    assert fired == [2] and telemetry.records == []  # the device has run nothing yet
    device.run_until(7.0)
    comm = EventClock(device.event)
    span = Span(comm.stamp(), comm.stamp())  # a communication interval of 4 to 9.5 ms
    telemetry.on_forward((x,), {}, True, lambda: (span, None))
    assert [r.step_ms for r in telemetry.records] == [7.0]  # step 1 is read, the rest wait
    device.run_until()
    records = telemetry.to_dict()["records"]
    assert [r["step_ms"] for r in records] == [7.0, 3.0, 15.0]
    assert records[2]["exposed_comm_ms"] == pytest.approx(5.5) and records[2]["samples"] == 4
