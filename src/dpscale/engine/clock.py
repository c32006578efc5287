"""The one clock behind every time the engine, telemetry, the autotuner and the loop report.

On CPU it is the host's (`time.perf_counter`): a stamp is a float and every window is complete
the moment it is taken. On CUDA the host only enqueues work, and a collective's future is done
when it is enqueued (ProcessGroupNCCL), so host stamps around it measure the launch. There a stamp
is a CUDA event recorded on a stream (the compute stream, or the communication stream around a
reduction), and a window of stamps is read when every event has completed (`Event.query()`),
at a later step if need be: nothing waits for the device. Values to be read later (gradient
norms) go the same way: copied to pinned host memory behind an event (`to_host`).

Whoever holds stamps keeps them until `ready(stamps)` and only then asks `elapsed_ms`; what is
not ready yet is read at a later step, never dropped and never waited for.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

Stamp = Any  # a float (host clock) or an event with record/query/elapsed_time (event clock)


class HostRead:
    """A tensor's values on the host once `ready()`; `values()` reads host memory only."""

    def __init__(self, host: torch.Tensor, done: Stamp | None = None):
        self._host = host
        self._done = done

    def ready(self) -> bool:
        return self._done is None or bool(self._done.query())

    def values(self) -> list[float]:
        # numpy reads the host copy directly: no device is involved, so nothing can wait here
        assert self.ready(), "read a HostRead only once it is ready()"
        return [float(v) for v in np.asarray(self._host.numpy()).reshape(-1)]


class HostClock:
    """Host time: every stamp is final when taken (CPU transports, CPU tensors)."""

    # a synchronous transport reduces on the thread that runs backward: that time held compute up
    launch_holds_compute = True

    def stamp(self, stream: Any = None) -> Stamp:
        return time.perf_counter()

    def ready(self, stamps: Sequence[Stamp]) -> bool:
        return True

    def elapsed_ms(self, start: Stamp, end: Stamp) -> float:
        return (end - start) * 1e3

    def to_host(self, tensor: torch.Tensor) -> HostRead:
        return HostRead(tensor.detach())

    def wait(self, stamps: Sequence[Stamp]) -> None:
        pass


class EventClock:
    """Device time from events recorded on the streams where the work runs.

    `event` makes an event with timing enabled (torch.cuda.Event; a test passes a fake one)."""

    # a launch holds up the host, which runs ahead of the device, not the compute stream
    launch_holds_compute = False

    def __init__(self, event: Callable[[], Any] | None = None):
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))

    def stamp(self, stream: Any = None) -> Stamp:
        event = self._event()
        if stream is None:
            event.record()
        else:
            event.record(stream)
        return event

    def ready(self, stamps: Sequence[Stamp]) -> bool:
        return all(s.query() for s in stamps)

    def elapsed_ms(self, start: Stamp, end: Stamp) -> float:
        return float(start.elapsed_time(end))

    def to_host(self, tensor: torch.Tensor) -> HostRead:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        host.copy_(tensor.detach(), non_blocking=True)
        return HostRead(host, self.stamp())

    def wait(self, stamps: Sequence[Stamp]) -> None:
        """Wait for `stamps` (a sync): only for a decision every rank takes at the same step."""
        for s in stamps:
            s.synchronize()


Clock = HostClock | EventClock


def clock_for(device: torch.device | str | None) -> Clock:
    """Events on a CUDA device, host time anywhere else."""
    return EventClock() if device is not None and torch.device(device).type == "cuda" else HostClock()
