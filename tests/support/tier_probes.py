"""Probe tests for tests/test_tiers.py, which runs `make test-fast` and `make test` on this file: the
fast tier must leave out the slow probe and fail the one that starts a process; `make test` must
run its two lanes of slow tests side by side and fail when the waiting lane fails. Not collected by
the suite (the name does not match test_*.py); pytest collects a file named on its command line
whatever its name."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest


def test_probe_a_fast_test_that_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.slow
def test_probe_a_slow_test():
    pytest.fail("the fast tier ran a test marked slow")


def _meet(me: str, other: str) -> None:
    """Leave a mark and wait for the other lane's: both probes pass only if the lanes run at once."""
    marks = Path(os.environ["TIER_PROBE_DIR"])
    (marks / me).touch()
    deadline = time.monotonic() + 60  # far above two pytest start-ups, the lanes' offset
    while not (marks / other).exists():
        if time.monotonic() > deadline:
            pytest.fail(f"no mark from the {other} lane in 60 s: the lanes ran one after the other")
        time.sleep(0.1)


@pytest.mark.slow
def test_probe_lane_busy():
    _meet("busy", "waiting")


@pytest.mark.slow
@pytest.mark.waits
def test_probe_lane_waiting():
    _meet("waiting", "busy")


@pytest.mark.slow
@pytest.mark.waits
def test_probe_lane_waiting_fails():
    pytest.fail("the waiting lane's failure")
