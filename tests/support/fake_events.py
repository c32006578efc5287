"""CUDA events on CPU: each records the next time of a script and completes when the test says.

For the event clock (engine/clock.py): a test sets when each event happened and how far the
"device" has run, and checks that nothing waits for it (`synchronize` fails the test) and that
no time is read before its event completed (`elapsed_time` fails as CUDA's does).
"""

from __future__ import annotations


class FakeDevice:
    """A timeline for fake events: each record takes the next time (ms) from `times`; an event
    is complete once the device has run up to its time (`run_until`)."""

    def __init__(self, times):
        self.times = iter(times)
        self.done_ms = float("-inf")
        self.recorded = []

    def run_until(self, ms=float("inf")):
        self.done_ms = ms

    def event(self):
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, device):
        self.device = device
        self.ms = None

    def record(self, stream=None):
        self.ms = next(self.device.times)
        self.device.recorded.append(self)

    def query(self):
        return self.ms is not None and self.ms <= self.device.done_ms

    def elapsed_time(self, end):
        # CUDA raises on an event not yet complete: so does this one
        assert self.query() and end.query(), "elapsed_time on an incomplete event (would need a sync)"
        return end.ms - self.ms

    def synchronize(self):
        # waiting on an event the device has passed returns at once; any other wait is a sync
        assert self.query(), "waited for the device (an event not yet complete)"
