"""The failure summary names the rank to look at, once restarts are used up.

Before, a worker killed by a signal broke the summary (torch's error file holds "<NONE>", so the
designed "rank 1 was killed by signal 9" never appeared), and after a hang the headline blamed
rank 0, which had only timed out waiting for the rank that hung.
"""

import re

import pytest

from support.cli_runs import TRAIN, TRAIN_NO_CHECKPOINTS, run_cli

pytestmark = pytest.mark.slow  # starts processes (spawned ranks or the CLI)


def _headline(stderr: str) -> str:
    return stderr[stderr.rindex("dpscale train: error:") :].splitlines()[0]


def test_a_worker_killed_by_a_signal_is_named_with_the_signal(tmp_path):
    args = TRAIN + ["--checkpoint-dir", str(tmp_path / "ckpt"), "--max-restarts", "1"]
    p = run_cli(args, faults="kill@step=3,rank=1")  # every attempt
    assert p.returncode == 1, p.stderr
    assert _headline(p.stderr) == (
        "dpscale train: error: training with 2 workers failed after 2 attempts (--max-restarts 1); "
        "last failure: rank 1 was killed by signal 9 (SIGKILL)"
    ), p.stderr[-3000:]


def test_after_a_hang_the_headline_names_the_rank_that_hung(tmp_path):
    args = TRAIN_NO_CHECKPOINTS + ["--collective-timeout-s", "2", "--max-restarts", "0"]
    p = run_cli(args, faults="hang@step=3,rank=1")
    assert p.returncode == 1, p.stderr
    head = _headline(p.stderr)
    assert head.endswith("rank 1 hung: rank 0 timed out waiting for it in a collective:"), p.stderr[-3000:]
    # rank 0's traceback follows, naming where rank 1 runs
    assert re.search(r"rank 1 on host \S+ \([\d.]+\) did not report within 2 s", p.stderr), p.stderr[-3000:]
