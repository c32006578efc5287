"""A look every few tenths of a second, on a thread of its own, while a with-block runs.

The launcher watches its workers this way while torch's agent waits for them (the agent's own loop
is not ours to extend): stopped workers (stopped_workers.py).
"""

from __future__ import annotations

import threading


class PeriodicWatch:
    """Calls `look()` every `interval_s` from a daemon thread while in use (`with watch:`); with
    `at_once` the first look comes as the block starts, otherwise one interval in. Leaving the block
    ends the thread after the look under way, if any."""

    def __init__(self, name: str, interval_s: float, *, at_once: bool) -> None:
        self._interval_s = interval_s
        self._at_once = at_once
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def look(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> PeriodicWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        if self._at_once:
            self.look()
        while not self._done.wait(self._interval_s):
            self.look()
