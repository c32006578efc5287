"""Every command that starts ranks ends them (#34): `dpscale run`, `scale` and `bench allreduce`
(and so every bench and `study`, through the lab's ranks) sent SIGKILL, SIGTERM or SIGINT leave
nothing of the job running two process starts later (5 s on a quiet host), no port open, nothing
in /dev/shm or the temp dir; a SIGTERM or SIGINT also ends the command with 128 + the signal and
one line saying so.

Before, `run` and `scale` left a `torchelastic_*` directory (and, on SIGTERM, exited silently),
and `bench allreduce` left both ranks spinning at 100% CPU, multiprocessing's forkserver and
resource tracker, and a `dpscale-ranks-*` directory.
"""

import glob
import os
import signal
import time
from pathlib import Path

import pytest

from support.cli_runs import (
    StderrWatch,
    describe,
    kill_tagged,
    shm_paths_in_use,
    start_cli,
    tagged,
    wait_until_gone,
)
from support.sockets import listening
from support.timing import process_baseline_once_s

pytestmark = pytest.mark.slow  # starts processes (the CLI and its ranks)

# the "5 s later" on a quiet host, where one process start takes ~3 s: two starts of this
# host now, so that a host at load 4 (everything slower, the kills' reaper included) gets as long
GONE_WITHIN_PROCESS_STARTS = 2
STARTED_WITHIN_S = 120

# a script that joins the group, says it is in, then waits for ever (what a signal ends)
SCRIPT = """
import datetime, os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
open(os.path.join(os.environ["READY_DIR"], str(dist.get_rank())), "w").close()
while True:
    time.sleep(0.05)
"""

COMMANDS = {
    "run": lambda script: ["run", "--nproc", "2", script],
    "scale": lambda script: ["scale", "--nproc", "2", "--steps", "5", "--warmup", "1", "--", script],
    "bench allreduce": lambda script: ["bench", "allreduce", "--nproc", "2", "--transport", "gloo"],
}


def _started(name: str, ready: Path, tmp: Path) -> bool:
    if name == "bench allreduce":  # both ranks joined their FileStore: their work is under way
        return any(glob.glob(str(tmp / "**" / "dpscale-ranks-*" / "rank1.stack"), recursive=True))
    return len(list(ready.iterdir())) == 2


def _listening_ports() -> set[int]:
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_signal_to_the_command_ends_its_whole_job(tmp_path, command, sig):
    script, ready, tmp = tmp_path / "wait.py", tmp_path / "ready", tmp_path / "tmp"
    script.write_text(SCRIPT)
    ready.mkdir()
    tmp.mkdir()
    env = dict(os.environ, READY_DIR=str(ready), TMPDIR=str(tmp))
    proc, tag = start_cli(COMMANDS[command](str(script)), env=env, cwd=tmp_path)
    try:
        watch = StderrWatch(proc)
        deadline = time.monotonic() + STARTED_WITHIN_S
        while not _started(command, ready, tmp):
            assert proc.poll() is None, f"ended before the ranks started:\n{watch.text()[-3000:]}"
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.05)
        job = tagged(tag)
        ports = {int(p.rsplit(":", 1)[1]) for p in listening(job)}
        shm = shm_paths_in_use(job)
        proc.send_signal(sig)
        proc.wait(timeout=60)
        within_s = GONE_WITHIN_PROCESS_STARTS * process_baseline_once_s()
        left = wait_until_gone(tag, within_s)
        assert not left, f"still running {within_s:.0f} s after {sig.name}: {describe(left)}"
        assert not ports & _listening_ports(), f"ports of the job still open: {ports & _listening_ports()}"
        assert not [p for p in shm if os.path.exists(p)], f"left in /dev/shm: {shm}"
        # torch's compile cache is meant to outlive every run (in /tmp, unless TMPDIR says otherwise)
        left_files = [n for n in os.listdir(tmp) if not n.startswith("torchinductor_")]
        assert not left_files, f"left in the temp dir: {left_files}"
        if sig != signal.SIGKILL:
            assert proc.returncode == 128 + sig, watch.text()[-3000:]
            last = watch.text().strip().splitlines()[-1]
            assert last == f"dpscale {command.split()[0]}: stopped by {sig.name}", last
    finally:
        kill_tagged(tag)
        proc.wait()


# a script that saves on Ctrl-C (SIGINT): it counts the SIGINTs it gets and needs a moment to save
SAVES_ON_SIGINT = """
import datetime, os, signal, time
import torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, out = dist.get_rank(), os.environ["READY_DIR"]
def save(signum, frame):
    with open(os.path.join(out, f"sigint-{rank}"), "a") as f:
        f.write("x")
    time.sleep(1.0)
    open(os.path.join(out, f"saved-{rank}"), "w").close()
    os._exit(0)
signal.signal(signal.SIGINT, save)
open(os.path.join(out, str(rank)), "w").close()
while True:
    time.sleep(0.05)
"""


def test_ctrl_c_at_the_terminal_reaches_each_worker_once_and_lets_it_save(tmp_path):
    # the terminal sends SIGINT to its foreground process group; before, that held the command and
    # torchrun's agent, which then got it twice (from the terminal and from the command) and died
    # in the middle of stopping the workers, which were killed before they had saved
    script, ready = tmp_path / "saves.py", tmp_path / "ready"
    script.write_text(SAVES_ON_SIGINT)
    ready.mkdir()
    env = dict(os.environ, READY_DIR=str(ready))
    proc, tag = start_cli(["run", "--nproc", "2", str(script)], env=env, cwd=tmp_path, start_new_session=True)
    try:
        watch = StderrWatch(proc)
        deadline = time.monotonic() + STARTED_WITHIN_S
        while not all((ready / str(rank)).exists() for rank in (0, 1)):
            assert proc.poll() is None, f"ended before the ranks started:\n{watch.text()[-3000:]}"
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does
        proc.wait(timeout=60)
        assert proc.returncode == 130, watch.text()[-3000:]
        assert watch.text().strip().splitlines()[-1] == "dpscale run: stopped by SIGINT"
        for rank in (0, 1):
            assert (ready / f"sigint-{rank}").read_text() == "x", f"rank {rank}: SIGINT more than once"
            assert (ready / f"saved-{rank}").exists(), f"rank {rank} was killed before it saved"
        assert not wait_until_gone(tag, GONE_WITHIN_PROCESS_STARTS * process_baseline_once_s())
    finally:
        kill_tagged(tag)
        proc.wait()
