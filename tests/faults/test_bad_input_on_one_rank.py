"""Bad input seen by one rank only ends the job at once with exit 2, on the same line as always.

A ConfigError on one rank (a checkpoint that does not fit there, user code that raised there)
used to leave the other ranks waiting in a collective for the rank that left: for the whole
collective timeout with shared memory, after which they failed and the agent restarted the job
(launch/refusal_watch.py now ends them within about a second).
"""

import time

import pytest

from support.cli_runs import TRAIN_NO_CHECKPOINTS, run_cli

pytestmark = pytest.mark.slow  # starts processes (the CLI and its ranks)

COLLECTIVE_TIMEOUT_S = 120  # what the other rank waited before; the test ends well within it


def test_bad_input_on_one_rank_ends_every_rank_at_once_with_exit_2():
    args = [*TRAIN_NO_CHECKPOINTS, "--max-restarts", "2", "--collective-timeout-s", str(COLLECTIVE_TIMEOUT_S)]
    start = time.monotonic()
    p = run_cli(args, faults="refuse@step=3,rank=1", timeout_s=2 * COLLECTIVE_TIMEOUT_S)
    took_s = time.monotonic() - start
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1] == "dpscale train: error: injected bad input: step 3, rank 1"
    # nothing timed out and nothing restarted: the first attempt's start-up and three steps, not
    # the collective timeout (the slowest start-up under load is a fraction of it)
    assert "did not report" not in p.stderr and "attempt 1" not in p.stderr, p.stderr[-3000:]
    assert took_s < COLLECTIVE_TIMEOUT_S, f"took {took_s:.0f} s"
    assert p.stdout.strip() == ""
