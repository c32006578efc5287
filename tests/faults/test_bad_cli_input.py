"""Scenario 12: bad command-line input is one line on stderr, exit code 2, and nothing written.

Checked in-process through `dpscale.cli.main` (fast), and once as a real subprocess so the exit
code and the single line are what a shell sees.
"""

import pytest

from conftest import run_cli
from dpscale.cli import main


@pytest.mark.parametrize(
    "args,words",
    [
        (["--global-batch", "-4"], "global_batch must be a positive integer, got -4"),
        (["--micro-batch", "-1"], "micro_batch must be a positive integer"),
        (["--nproc", "4", "--global-batch", "2"], "world size 4 is larger than global_batch 2"),
        (["--nproc", "1:3", "--global-batch", "64"], "multiple of 3"),
        (["--nproc", "3:2"], "--nproc must be N or MIN:MAX with 1 <= MIN <= MAX, got '3:2'"),
        (["--nproc", "0"], "--nproc must be N or MIN:MAX"),
        (["--nproc", "two"], "--nproc must be N or MIN:MAX"),
        (["--max-restarts", "-1"], "--max-restarts must be >= 0"),
        (["--resume", "--checkpoint-dir", "MISSING"], "does not exist"),
        (["--collective-timeout-s", "0"], "collective_timeout_s must be at least 1 second"),
        (["--drift-check-every", "-5"], "drift_check_every must be >= 0"),
        (["--check-collectives-steps", "-1"], "check_collectives_steps must be >= 0"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, args, words):
    args = [a.replace("MISSING", str(tmp_path / "nope")) for a in args]
    if "--checkpoint-dir" not in args:
        args += ["--checkpoint-dir", str(tmp_path / "ckpt")]
    code = main(["train", "--metrics-dir", str(tmp_path / "metrics"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("dpscale train: error: ") and words in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_bad_input_from_a_shell(tmp_path):
    p = run_cli(["train", "--nproc", "4", "--global-batch", "2", "--checkpoint-dir", str(tmp_path / "c")])
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and "larger than global_batch" in p.stderr
    assert p.stdout == "" and list(tmp_path.iterdir()) == []
