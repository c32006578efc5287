"""Two probe tests for tests/test_tiers.py, which runs `make test-fast` on this file: the fast tier must
leave out the slow one and fail the other, which starts a process. Not collected by the suite (the
name does not match test_*.py); pytest collects a file named on its command line whatever its name."""

import subprocess
import sys

import pytest


def test_probe_a_fast_test_that_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.slow
def test_probe_a_slow_test():
    pytest.fail("the fast tier ran a test marked slow")
