"""Scenarios 5 and 8 through the CLI: a worker that always raises, and a non-finite gradient.

5: restarts do not help a deterministic bug. The job must stop after max_restarts + 1 attempts,
exit non-zero, and show the worker's own traceback, not only the agent's summary.
8: a NaN gradient on one rank at one step makes every rank skip that step; the drift check run
after every step (--drift-check-every 1) proves the replicas stayed bit-identical throughout.
"""

import json
import math

import pytest

from support.cli_runs import TRAIN, TRAIN_NO_CHECKPOINTS, last_json, run_cli

pytestmark = pytest.mark.slow  # starts processes (spawned ranks or the CLI)


def test_worker_that_always_raises_fails_the_job_after_every_attempt(tmp_path):
    # one restart is enough to show that restarts do not help and that the count is kept
    p = run_cli(
        TRAIN + ["--checkpoint-dir", str(tmp_path / "ckpt"), "--max-restarts", "1"], faults="raise@rank=1"
    )
    assert p.returncode == 1, p.stderr
    final = p.stderr[p.stderr.rindex("dpscale train: error:") :]
    assert final.startswith(
        "dpscale train: error: training with 2 workers failed after 2 attempts (--max-restarts 1); "
        "last failure: rank 1 exited with code 1:"
    ), final
    # the worker's traceback, down to the line that raised, from the last attempt
    assert "Traceback (most recent call last):" in final and "in on_batch" in final
    assert "InjectedFault: injected fault: step 1, rank 1, attempt 1" in final
    # one failure per attempt, and no third attempt
    for attempt in range(2):
        assert f"attempt {attempt}" in p.stderr
    assert "attempt 2" not in p.stderr
    assert p.stdout.strip() == "", "no result may be printed for a failed job"


def test_non_finite_gradient_on_one_rank_is_skipped_by_every_rank(tmp_path):
    metrics = tmp_path / "metrics"
    args = TRAIN_NO_CHECKPOINTS + [
        "--max-steps",
        "8",
        "--drift-check-every",
        "1",
        "--metrics-dir",
        str(metrics),
    ]
    p = run_cli(args, faults="nan_grad@step=3,rank=1")
    assert p.returncode == 0, p.stderr
    out = last_json(p.stdout)
    assert out["steps"] == 8 and out["skipped_steps"] == 1
    assert "step 3: non-finite gradient on at least one rank; every rank skipped this step" in p.stderr
    lines = [json.loads(x) for x in (metrics / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, 9))
    assert [m["skipped"] for m in lines] == [s == 3 for s in range(1, 9)]
    assert all(math.isfinite(m["loss"]) for m in lines[3:]), "training went on after the skip"
