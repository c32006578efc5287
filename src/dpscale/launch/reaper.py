"""`python .../reaper.py JOB_ID JOB_DIR`: what ends a job when the command that started it cannot.

Started by `job.job_scope` as a process of its own (its own session, so a Ctrl-C to the terminal
does not reach it) with a pipe on stdin that only the command holds. It waits on that pipe; when
the command closes it (it finished, or was stopped) or the kernel does (the command was killed,
even with SIGKILL), the reaper kills every process that carries the job's marker in its
environment (the agent, the workers, the lab's ranks, multiprocessing's forkserver and resource
tracker: whatever the job started, however deep) and removes the job's directory, the temp dir
every one of them wrote to (torch elastic's logs, the launch spec, the ranks' files).

The command may name more on the pipe: processes ("pid N") it forked without an environment of
its own (the lab's ranks, forked by multiprocessing's forkserver, carry the server's), and paths
("path P") that live as long as the command, not the job (the forkserver's socket directory),
removed only if the command dies. Its last line says how the job ended: "done" (what it started
has ended; only the directory goes), "abort" (an exception: kill what is left too), or nothing
(the command died: everything goes).

Run as a file, not `-m dpscale...`: importing the package would import torch (seconds, and
memory) into a process that needs only the standard library. Linux: processes are found in /proc;
elsewhere only the directory is removed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from pathlib import Path

JOB_ENV = "DPSCALE_JOB"  # every process of a job carries DPSCALE_JOB=<id> in its environment
PID, PATH, DONE, ABORT = "pid", "path", "done", "abort"  # the words of the pipe
# a process forked while we scan is found on the next scan; give up after this long
_KILL_FOR_S = 10.0


def job_processes(job_id: str) -> list[int]:
    """Live processes (not zombies) other than this one whose environment holds JOB_ENV=`job_id`."""
    needle = f"{JOB_ENV}={job_id}".encode() + b"\0"
    found: list[int] = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes():
                continue
        except OSError:
            continue
        if process_state(int(entry.name)) not in ("", "Z"):
            found.append(int(entry.name))
    return found


def process_state(pid: int) -> str:
    """The state letter of process `pid` (R, S, T, Z, ...) from /proc, or "" where it cannot be read."""
    try:
        # field 3 of /proc/PID/stat; the name (field 2) may hold spaces
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def process_start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot, from /proc), or None where it cannot be
    read (gone, or not Linux). With the pid, it names one process: a pid is reused, this is not."""
    try:
        # field 22 of /proc/PID/stat, the 20th after the name
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    return process_state(pid) not in ("", "Z")


def end_job(job_id: str, job_dir: str, named: set[int]) -> None:
    """Kill every process of the job and those `named`, then remove the job's directory."""
    deadline = time.monotonic() + _KILL_FOR_S
    while (left := job_processes(job_id) + [p for p in named if _alive(p)]) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.02)
    shutil.rmtree(job_dir, ignore_errors=True)


def main(job_id: str, job_dir: str) -> None:
    # the job ends when the pipe does, not on a signal meant for the command (a terminal's SIGHUP)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    named: set[int] = set()
    paths: list[str] = []
    end = ""
    for line in sys.stdin:  # EOF: the command closed the pipe, or died
        word, _, value = line.strip().partition(" ")
        if word == PID and value.isdigit():
            named.add(int(value))
        elif word == PATH and value:
            paths.append(value)
        elif word in (DONE, ABORT):
            end = word
    if end == DONE:
        shutil.rmtree(job_dir, ignore_errors=True)
        return
    end_job(job_id, job_dir, named)
    if not end:  # the command died: what it kept beyond the job goes too
        for path in paths:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:  # a file: a named semaphore of multiprocessing's (fork_start.SemaphoreWatch)
                with contextlib.suppress(OSError):
                    os.remove(path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
