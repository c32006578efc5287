"""The launcher is killed (`kill -9` of `dpscale train`): its workers end within seconds, also when
it dies while restarting them, and nothing of the job stays in /dev/shm.

Nor in the temp dir: before, each kill left `dpscale-launch-*/spec.json` and `torchelastic_*`.

Before, workers kept training and writing checkpoints after their launcher was gone, and a later
`--resume` read checkpoints that were still being written; each killed job left nine
`/dev/shm/sem.mp-*` semaphores (multiprocessing's, for the agent's forkserver children). The agent
forks the workers again (launch/fork_start.py) and uses such semaphores while they run:
multiprocessing's resource tracker removes them once every process of the job is gone.
"""

import os
import signal
import time

import pytest

from support.cli_runs import (
    TRAIN,
    StderrWatch,
    kill_tagged,
    shm_paths_in_use,
    start_cli,
    tagged,
    wait_until_gone,
)
from support.timing import process_baseline_once_s

pytestmark = pytest.mark.slow  # starts processes (spawned ranks or the CLI)

# PR_SET_PDEATHSIG ends a running worker at once; one still importing torch when its launcher
# dies ends when it reaches the check: within a few process starts of this host (~11 s quiet)
GONE_WITHIN_PROCESS_STARTS = 4
LONG = [a if a != "30" else "100000" for a in TRAIN] + ["--log-every", "5"]


def _kill_launcher_and_check(proc, tag, ckpt, tmp) -> None:
    job = tagged(tag)
    assert proc.pid in job and len(job) >= 3, f"launcher and 2 workers expected, got {job}"
    shm = shm_paths_in_use(job)  # multiprocessing's semaphores, for the agent and its forked workers
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    within_s = GONE_WITHIN_PROCESS_STARTS * process_baseline_once_s()
    t0 = time.monotonic()
    left = wait_until_gone(tag, within_s)
    if left:
        kill_tagged(tag)
    assert not left, f"processes still running {within_s:.0f} s after the launcher died: {left}"
    assert not [p for p in shm if os.path.exists(p)], f"left in /dev/shm: {shm}"
    print(f"workers gone {time.monotonic() - t0:.1f} s after the launcher")
    # nothing writes any more: the checkpoint directory stays as it is
    before = sorted(os.listdir(ckpt)) if ckpt.exists() else []
    time.sleep(1.5)
    assert (sorted(os.listdir(ckpt)) if ckpt.exists() else []) == before
    # torch's compile cache is meant to outlive every run (in /tmp, unless TMPDIR says otherwise)
    left = [n for n in os.listdir(tmp) if not n.startswith("torchinductor_")]
    assert not left, f"left in the temp dir: {left}"


def _start(args, tmp_path, **kwargs):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return (*start_cli(args, env=dict(os.environ, TMPDIR=str(tmp)), **kwargs), tmp)


def test_workers_end_when_the_launcher_is_killed(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc, tag, tmp = _start(LONG + ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "5"], tmp_path)
    try:
        watch = StderrWatch(proc)
        watch.wait_for("step 10/")
        _kill_launcher_and_check(proc, tag, ckpt, tmp)
    finally:
        kill_tagged(tag)


@pytest.mark.slow  # a failure, a restart and a kill; the fast tier keeps the plain kill
def test_workers_end_when_the_launcher_is_killed_while_restarting_them(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = LONG + ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "5", "--max-restarts", "3"]
    proc, tag, tmp = _start(args, tmp_path, faults="kill@step=8,rank=1,attempt=0")
    try:
        watch = StderrWatch(proc)
        # the agent stops the first attempt's survivor to restart all: torch logs it as "Closing
        # process PID via signal" for forked workers ("... closing signal" for started ones)
        watch.wait_for("via signal" if os.environ.get("DPSCALE_WORKER_START") != "exec" else "closing signal")
        deadline = time.monotonic() + 30
        while len(tagged(tag)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # the new attempt's workers are starting
        _kill_launcher_and_check(proc, tag, ckpt, tmp)
    finally:
        kill_tagged(tag)


def test_a_kill_of_the_whole_job_at_once_leaves_nothing_in_dev_shm(tmp_path):
    # SIGKILL to the command's process group: the command, the workers' server, the workers and
    # multiprocessing's resource tracker (which would remove the agent's semaphores) all at once;
    # the job's reaper, in a session of its own, is what is left to remove them
    ckpt = tmp_path / "ckpt"
    args = LONG + ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "5"]
    proc, tag, tmp = _start(args, tmp_path, start_new_session=True)
    try:
        StderrWatch(proc).wait_for("step 10/")
        shm = shm_paths_in_use(tagged(tag))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        within_s = GONE_WITHIN_PROCESS_STARTS * process_baseline_once_s()
        left = wait_until_gone(tag, within_s)  # the reaper too, once it has done its work
        assert not left, f"processes still running {within_s:.0f} s after the job was killed: {left}"
        assert not [p for p in shm if os.path.exists(p)], f"left in /dev/shm: {shm}"
    finally:
        kill_tagged(tag)
