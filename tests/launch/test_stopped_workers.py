"""A worker stopped for good (SIGSTOP) is killed past the limit; a whole job suspended and continued
is not (#34 review): the time the launcher itself was stopped does not count."""

import os
import signal
import subprocess
import sys
import time

import pytest

from dpscale.launch.stopped_workers import StoppedClock


def test_a_worker_stopped_past_the_limit_is_named():
    clock = StoppedClock(limit_s=2.0, most_per_look_s=1.0)
    found = [clock.look(t / 2, {7}) for t in range(6)]  # looks every 0.5 s, stopped at each
    assert found[:4] == [[], [], [], []] and found[4] == [(7, 2.0)]


def test_a_worker_seen_running_starts_again_from_zero():
    clock = StoppedClock(limit_s=2.0, most_per_look_s=1.0)
    for t in range(4):
        clock.look(t / 2, {7})
    clock.look(2.0, set())  # continued
    assert [clock.look(2.0 + t / 2, {7}) for t in range(1, 5)] == [[], [], [], []]


def test_the_time_the_launcher_was_suspended_does_not_count():
    clock = StoppedClock(limit_s=5.0, most_per_look_s=1.0)
    clock.look(0.0, {7})
    clock.look(0.5, {7})
    # the whole job was suspended for 10 minutes; continued, the worker is a moment behind the launcher
    assert clock.look(600.5, {7}) == []
    assert clock.look(601.0, set()) == []


LAUNCHER = """
import os, subprocess, sys, time
from dpscale.launch.stopped_workers import StoppedWorkers
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         env=dict(os.environ, TORCHELASTIC_RUN_ID="job-1"))
print(child.pid, flush=True)
with StoppedWorkers(5.0, "job-1"):
    sys.stdin.readline()  # until the test is done suspending us
    time.sleep(1.5)
print("alive" if child.poll() is None else f"killed {child.returncode}", flush=True)
child.kill()
"""


@pytest.mark.slow
@pytest.mark.waits  # on the suspended job
def test_a_whole_job_suspended_then_continued_keeps_its_workers():
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        worker = int(launcher.stdout.readline())
        os.kill(worker, signal.SIGSTOP)  # a scheduler's suspend reaches the processes one by one
        time.sleep(1.0)
        os.kill(launcher.pid, signal.SIGSTOP)
        time.sleep(8.0)
        os.kill(launcher.pid, signal.SIGCONT)  # continued first, the worker a moment later
        time.sleep(0.6)
        os.kill(worker, signal.SIGCONT)
        launcher.stdin.write("\n")
        launcher.stdin.flush()
        assert launcher.stdout.readline().strip() == "alive"
    finally:
        launcher.kill()
        launcher.wait()
