"""`--cpu-times FILE`: each test's wall and CPU seconds, one tab-separated line per test (#28).

What sorts the slow tests into the two lanes of `make test` (marker `waits`): a test whose CPU
seconds are a small part of its wall seconds mostly waits (on its own timeouts, a stopped worker, a
cut link) and can run beside one that keeps both cores busy.

CPU is that of this pytest process and every process that was below it during the test. Neither
`getrusage(RUSAGE_CHILDREN)` nor a parent's reaped-children times suffice: the ranks are children
of a long-lived forkserver, and a test that kills a launcher leaves its workers to init. So the
process tree is sampled from /proc every SAMPLE_S while the test runs, and each process seen in it
counts with its own CPU time as last read (a process that lives less than SAMPLE_S may be missed,
as may the last SAMPLE_S of each one). Setup and teardown count to the test.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

SAMPLE_S = 0.1
_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, clock ticks the process itself used so far)."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:  # ended while the table was read
            continue
        # the fields after the command name (which may hold spaces and parentheses): state is
        # field 3, ppid 4, utime and stime 14 and 15 (proc(5))
        fields = stat[stat.rindex(")") + 2 :].split()
        found[int(name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    return found


class TreeCpu:
    """CPU ticks of every process seen below `root` (itself included) since `start`."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="cpu-times")

    def sample(self) -> None:
        table = _processes()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        # what is below the root now, and what was once (a worker whose launcher was killed)
        todo = [self.root, *(pid for pid in self.seen if pid in table)]
        while todo:
            pid = todo.pop()
            if pid in table:
                self.seen[pid] = table[pid][1]
                todo.extend(c for c in children.get(pid, []) if c not in self.seen)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sample()

    def start(self) -> dict[int, int]:
        self.sample()
        before = dict(self.seen)
        self._thread.start()
        return before

    def stop(self, before: dict[int, int]) -> float:
        self._stop.set()
        self._thread.join()
        self.sample()
        return sum(t - before.get(pid, 0) for pid, t in self.seen.items()) * _TICK_S


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-times",
        metavar="FILE",
        help="append each test's wall and CPU seconds (of pytest and the processes below it) to FILE",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    out = item.config.getoption("cpu_times")
    if not out:
        yield
        return
    tree = TreeCpu(os.getpid())
    wall0, before = time.monotonic(), tree.start()
    yield
    cpu, wall = tree.stop(before), time.monotonic() - wall0
    # one write per line in append mode: xdist workers may share the file
    with open(out, "a") as f:
        f.write(f"{wall:.2f}\t{cpu:.2f}\t{cpu / max(wall, 1e-9):.2f}\t{item.nodeid}\n")
