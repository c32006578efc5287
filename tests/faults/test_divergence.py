"""A diverging run stops instead of reporting success.

Before, `--lr 1e6` on synthetic skipped 28 of 30 steps (non-finite gradients), ended with a NaN
loss and exit code 0. Now `--max-skipped-steps` (default 10) steps in a row stop it with exit code 3
and one line that names the step and the cause.
"""

import pytest

from dpscale.cli.main import main
from support.cli_runs import TRAIN, last_json, run_cli

DIVERGE = ["--workload", "synthetic", "--max-steps", "30", "--lr", "1e6", "--progress", "none"]


@pytest.mark.slow
def test_a_diverging_run_stops_with_exit_3_naming_the_step(tmp_path):
    p = run_cli(TRAIN + ["--lr", "1e6", "--checkpoint-dir", str(tmp_path / "ckpt")])
    assert p.returncode == 3, p.stderr
    out = last_json(p.stdout)
    assert out["stopped_by"] == "diverged" and out["skipped_steps"] == 10 and out["steps"] < 30
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(f"dpscale train: stopped at step {out['steps']}: steps ")
    assert "(10 in a row) had a non-finite gradient" in last and "--max-skipped-steps" in last
    assert "Traceback" not in p.stderr
    # no final checkpoint of the diverged run (skipped steps leave the parameters as they were, so
    # one written by --checkpoint-every while skipping holds the last good state)
    assert not (tmp_path / "ckpt" / f"step-{out['steps']:08d}").exists()


def test_max_skipped_steps_sets_the_allowance_in_process(capsys):
    assert main(["train", *DIVERGE, "--max-skipped-steps", "3"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert "(3 in a row) had a non-finite gradient" in err[-1], err
    # 0: never stop (the old behaviour, on request)
    assert main(["train", *DIVERGE, "--max-skipped-steps", "0"]) == 0
