"""Two jobs on one --checkpoint-dir: the second is refused at once, naming the first one's PID.

Before, the second job deleted the first's temporary directory as "stale" and the first died with
FileNotFoundError. (That the checkpoint writer now removes only temporary directories whose writer
is gone is tested beside it, in tests/train/test_checkpoint.py.)
"""

import os
import signal
import time
from pathlib import Path

import pytest

from dpscale.cli.main import main
from dpscale.launch import dir_lock
from support.cli_runs import TRAIN, StderrWatch, kill_tagged, run_cli, start_cli, tagged
from support.timing import process_baseline_s


def test_a_second_job_on_a_held_directory_is_refused_in_process(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    with dir_lock.hold(str(ckpt)):
        code = main(["train", "--workload", "synthetic", "--max-steps", "2", "--checkpoint-dir", str(ckpt)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"--checkpoint-dir {ckpt} is in use by the process with PID {os.getpid()}" in err[0]
    assert list(ckpt.iterdir()) == []
    # released: the directory is free again
    assert main(["train", "--workload", "synthetic", "--max-steps", "2", "--checkpoint-dir", str(ckpt)]) == 0


@pytest.mark.slow
def test_a_second_dpscale_train_is_refused_while_the_first_runs(tmp_path):
    ckpt = tmp_path / "ckpt"
    long_run = [a if a != "30" else "100000" for a in TRAIN]
    long_run += ["--log-every", "5", "--checkpoint-dir", str(ckpt)]
    first, tag = start_cli(long_run)
    try:
        StderrWatch(first).wait_for("step 5/")
        # Pause the first job's workers: training flat out they held both of CI's cores while
        # the second job started, and its refusal took 28 s at load 9. The launcher, which holds
        # the directory's lock, runs on, and so do its reaper and multiprocessing's processes
        # (the reaper, stopped, could not end the job). SIGKILL at the end ends stopped workers too.
        for pid in tagged(tag):
            if _name(pid).startswith("dpscale-rank"):
                os.kill(pid, signal.SIGSTOP)
        bound_s = 4 * process_baseline_s()  # one start of the command line, not a worker's too
        t0 = time.monotonic()
        second = run_cli(TRAIN + ["--checkpoint-dir", str(ckpt)])
        assert second.returncode == 2, second.stderr
        assert f"is in use by the process with PID {first.pid}" in second.stderr
        assert len(second.stderr.strip().splitlines()) == 1
        assert time.monotonic() - t0 < bound_s  # refused before any worker started
        assert first.poll() is None, "the first job must go on"
    finally:
        kill_tagged(tag)
        first.wait()


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text()
    except OSError:
        return ""
