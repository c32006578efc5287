"""Run the `dpscale` CLI as a user would, in a process of its own, and check it leaves nothing running.

Each CLI run carries a tag in its environment, which every process it starts inherits (workers
run in sessions of their own), so after it exits the helper can check that nothing it started is
still running, and kill what is.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import tomllib
import uuid
from pathlib import Path

import pytest

from support.timing import process_baseline_once_s

ROOT = Path(__file__).resolve().parents[2]  # the repository
# 2 workers, 30 steps, a checkpoint every 10: kills at 15 lose 5 steps, resumes start at 10 or 20.
# `synthetic` needs no scikit-learn import, which would cost each worker seconds.
TRAIN = [
    "train",
    "--nproc",
    "2",
    "--workload",
    "synthetic",
    "--max-steps",
    "30",
    "--checkpoint-every",
    "10",
    "--json",
    "--progress",
    "plain",
]
# TRAIN for a run without a checkpoint directory (--checkpoint-every alone is refused)
TRAIN_NO_CHECKPOINTS = [
    a for i, a in enumerate(TRAIN) if "--checkpoint-every" not in TRAIN[max(i - 1, 0) : i + 1]
]


TAG = "DPSCALE_TEST_RUN"


def tagged(tag: str) -> list[int]:
    """Live processes (not zombies) whose environment holds TAG=`tag`: a CLI run and all it started."""
    needle = f"{TAG}={tag}".encode() + b"\0"
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle not in (entry / "environ").read_bytes():
                    continue
                # field 3 of /proc/PID/stat is the state; the name (field 2) may hold spaces
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(entry.name))
            except (OSError, IndexError):
                continue
    return pids


def kill_tagged(tag: str, reaper_within_s: float = 20) -> None:
    """SIGKILL what is left of a CLI run, as `kill -9` of its process group would, but for the
    job's reaper (launch/reaper.py: in a session of its own, out of a group kill's reach), which is
    left to do its work (remove the job's directory and, once the command is dead, the semaphores
    of the agent's queues) for up to `reaper_within_s`, then killed too if still there."""
    _kill([pid for pid in tagged(tag) if not _is_reaper(pid)])
    for pid in tagged(tag):  # a test may have stopped it with the rest (SIGSTOP)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + reaper_within_s
    while [pid for pid in tagged(tag) if _is_reaper(pid)] and time.monotonic() < deadline:
        time.sleep(0.05)
    _kill(tagged(tag))


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _is_reaper(pid: int) -> bool:
    return "dpscale/launch/reaper.py" in command_line(pid)


def command_line(pid: int) -> str:
    """Process `pid`'s command line, or "" where it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def describe(pids: list[int]) -> list[str]:
    """`pid: command line` of each, for a failure's message: which of a job's processes was left."""
    return [f"{pid}: {command_line(pid)[:200]}" for pid in pids]


def installed_command() -> list[str]:
    """`dpscale` as its installed console script starts it: the entry point named in pyproject's
    [project.scripts] imported and called, as the script pip writes does. Read from the tree, so a
    test follows a changed entry point without a reinstall."""
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["dpscale"]
    module, function = target.split(":")
    return [sys.executable, "-c", f"import sys\nfrom {module} import {function}\nsys.exit({function}())"]


def start_cli(
    args: list[str],
    *,
    faults: str | None = None,
    env: dict[str, str] | None = None,
    cwd=ROOT,
    installed: bool = False,
    **popen,
) -> tuple[subprocess.Popen, str]:
    """Start `python -m dpscale.cli.main ARGS` (DPSCALE_FAULTS=`faults`) in `cwd`, with `env`
    (default: this process's); returns it and its process tag. `installed`: start it as the
    installed `dpscale` command starts (installed_command), from its entry point's first line."""
    tag = uuid.uuid4().hex
    base = os.environ if env is None else env
    env = {k: v for k, v in base.items() if k not in ("DPSCALE_FAULTS", "DPSCALE_CALLBACKS")}
    env[TAG] = tag
    if faults:  # the faults reach the workers' trainers through a callback the workers build
        env["DPSCALE_FAULTS"] = faults
        env["DPSCALE_CALLBACKS"] = "dpscale.testing.faults:FaultInjector"
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **popen}
    command = installed_command() if installed else [sys.executable, "-m", "dpscale.cli.main"]
    proc = subprocess.Popen([*command, *args], cwd=cwd, env=env, **popen)
    return proc, tag


def wait_until_gone(tag: str, within_s: float) -> list[int]:
    """Wait up to `within_s` for every tagged process to end; returns those still running."""
    deadline = time.monotonic() + within_s
    while (left := tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def run_cli(
    args: list[str], *, faults: str | None = None, timeout_s: float = 150
) -> subprocess.CompletedProcess:
    """`python -m dpscale.cli.main ARGS` with DPSCALE_FAULTS=`faults`; fails if it leaves a process behind."""
    proc, tag = start_cli(args, faults=faults)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tagged(tag)
        out, err = proc.communicate()
        pytest.fail(f"dpscale {' '.join(args)} still ran after {timeout_s} s\n{err[-5000:]}")
    # the launcher has exited: its workers end at once, so this poll returns at once unless one is left
    if left := wait_until_gone(tag, 2 * process_baseline_once_s()):
        found = describe(left)
        kill_tagged(tag)
        pytest.fail(f"dpscale {' '.join(args)} left processes running: {found}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


class StderrWatch:
    """Reads a started CLI's stderr in a thread, so a test can wait for a line and still get all of it."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(proc.stderr,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()

    def wait_for(self, text: str, timeout_s: float = 120) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: any(text in line for line in self.lines), timeout_s):
                pytest.fail(f"no line with {text!r} within {timeout_s} s:\n{''.join(self.lines)[-5000:]}")

    def text(self) -> str:
        self._thread.join(timeout=30)
        return "".join(self.lines)


def shm_paths_in_use(pids: list[int]) -> set[str]:
    """/dev/shm files that these processes map or hold open (a memfd is not one: it has no name there)."""
    paths = set()
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    paths.add(line.split(None, 5)[-1].removesuffix(" (deleted)"))
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/dev/shm/"):
                    paths.add(target.removesuffix(" (deleted)"))
        except OSError:
            continue
    return paths
