"""Kill a worker stopped for good (SIGSTOP), so that the failure is named within seconds.

A stopped worker holds its peers until their collective times out; torch's agent then stops every
worker with SIGTERM, which a stopped process does not act on, and waits 30 s (its own, not the
shutdown timeout) before SIGKILL. `StoppedWorkers` kills a worker that has stayed stopped past the
collective timeout instead: its peers have timed out waiting for it by then and written who hung.

Only the agent's workers count (the children whose environment carries the agent's run id; not the
job's reaper; or, where the workers are forked from a server, the server's children: their
environment as /proc shows it is the server's, fork_start.py), and only the time this process itself
ran: when the whole job is suspended (every process stopped, then continued, as a scheduler's
suspend or a `kill -STOP` of the job does) the watch is stopped too, and a worker continued a moment
after this process must not look as if it had been stopped all along (`StoppedClock`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from dpscale.launch.periodic import PeriodicWatch
from dpscale.launch.reaper import process_state
from dpscale.log import get_logger

logger = get_logger(__name__)

WATCH_INTERVAL_S = 0.5
# what one look may add to a worker's stopped time: a longer gap means this process was not
# running (suspended with the job), and that time says nothing about the worker
_MOST_PER_LOOK_S = 2 * WATCH_INTERVAL_S
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"  # torch's agent gives each worker its run id in this variable


class StoppedClock:
    """How long each worker has been stopped, counting only the time between two looks that came
    on schedule (`most_per_look_s` at most per look)."""

    def __init__(self, limit_s: float, most_per_look_s: float = _MOST_PER_LOOK_S) -> None:
        self.limit_s = limit_s
        self._most_per_look_s = most_per_look_s
        self._stopped_s: dict[int, float] = {}
        self._last: float | None = None

    def look(self, now: float, stopped: set[int]) -> list[tuple[int, float]]:
        """Record a look at `now` that found `stopped`; the (pid, stopped seconds) past the limit."""
        step = 0.0 if self._last is None else min(max(now - self._last, 0.0), self._most_per_look_s)
        self._last = now
        # a worker seen running (or gone) starts from zero when it stops again
        self._stopped_s = {
            pid: self._stopped_s[pid] + step if pid in self._stopped_s else 0.0 for pid in stopped
        }
        return [(pid, s) for pid, s in self._stopped_s.items() if s >= self.limit_s]


class StoppedWorkers(PeriodicWatch):
    """While in use, a thread kills any worker of the agent `run_id` that stayed stopped for `limit_s`."""

    def __init__(self, limit_s: float, run_id: str, server_pid: int | None = None) -> None:
        super().__init__("dpscale-stopped-workers", WATCH_INTERVAL_S, at_once=False)
        self._clock = StoppedClock(limit_s)
        self._server_pid = server_pid
        self._needle = f"{RUN_ID_ENV}={run_id}".encode() + b"\0"

    def look(self) -> None:
        stopped = {pid for pid in self._workers() if process_state(pid) == "T"}
        for pid, seconds in self._clock.look(time.monotonic(), stopped):
            logger.warning("worker pid %d stayed stopped (SIGSTOP) for %.0f s: killing it", pid, seconds)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _workers(self) -> list[int]:
        if self._server_pid is not None:
            return children(self._server_pid)
        workers = []
        for pid in children():
            with contextlib.suppress(OSError):
                if self._needle in Path(f"/proc/{pid}/environ").read_bytes():
                    workers.append(pid)
        return workers


def children(pid: int | None = None) -> list[int]:
    """The children of process `pid`, this one by default (Linux: /proc/PID/task/*/children;
    elsewhere none)."""
    pids: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid or 'self'}/task").iterdir():
            with contextlib.suppress(OSError):
                pids += [int(p) for p in (task / "children").read_text().split()]
    return pids
