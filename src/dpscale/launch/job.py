"""One job: the processes a command starts, the temporary directory they write to, and their end.

Every command (cli/main.py) and every way dpscale starts processes (`dpscale train`'s agent,
`run`/`scale`'s torchrun, the lab's ranks, the ranks across hosts) runs inside `job_scope()`; a
scope inside another joins the outer one's job. A job

- has a directory of its own, and points the temp dir at it (TMPDIR, and `tempfile` in this
  process): torch elastic's `torchelastic_*` logs, the launch spec, the ranks' files, the
  workers' own temporary files all land there, and go with it;
- marks every process started inside with DPSCALE_JOB=<id> in its environment, which they pass
  on to theirs;
- has a reaper (reaper.py), started with the job's first process, which outlives the command by
  a moment: however the command ends (an exception, a signal, SIGKILL), it kills whatever of the
  job is still running and removes the directory.

A job directory whose command died before its reaper started is removed by the next job that
starts in the same temp dir. The directory's name carries the command's pid and the time that
process started: in a shared /tmp the pid may since belong to another process, which must not
keep the directory forever.

The kernel's parent-death signal (process_life.die_with_parent) ends most processes even sooner;
the reaper is what makes "nothing left" hold also for a process that had not got that far, a
stopped one, or a file.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from dpscale.launch import reaper
from dpscale.launch.reaper import JOB_ENV

_PREFIX = "dpscale-job-"
_INDUCTOR = "TORCHINDUCTOR_CACHE_DIR"
# how long the command waits for its reaper: killing what is left, removing the directory
_REAPER_WAIT_S = 20


class Job:
    """A running job: its id (the environment marker), its directory, and its reaper."""

    def __init__(self, job_id: str, directory: Path, outside: dict[str, str | None]) -> None:
        self.id = job_id
        self.directory = directory
        self._outside = outside  # TMPDIR and the marker as they were before the job
        self._reaper: subprocess.Popen | None = None

    def start_reaper(self) -> None:
        """Start the reaper, before the job's first process (idempotent)."""
        if self._reaper is not None:
            return
        own_env = {k: v for k, v in os.environ.items() if k != JOB_ENV}  # an outer job's reaper leaves it be
        self._reaper = subprocess.Popen(
            # -I: the standard library only, nothing of the environment's Python settings
            [sys.executable, "-I", reaper.__file__, self.id, str(self.directory)],
            stdin=subprocess.PIPE,
            text=True,
            env=own_env,
            start_new_session=True,  # a Ctrl-C to the terminal's process group does not reach it
        )

    def add(self, pid: int) -> None:
        """Have the reaper end process `pid` too (one started without this process's environment)."""
        self._tell(f"{reaper.PID} {pid}")

    def add_path(self, path: str) -> None:
        """Have the reaper remove `path` too, should this process die (it outlives a job that ends)."""
        self._tell(f"{reaper.PATH} {path}")

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """The block runs with the temp dir and environment from before the job: for what is shared
        with the caller's later jobs (multiprocessing's forkserver, its socket's directory)."""
        inside = {name: os.environ.get(name) for name in self._outside}
        _set_env(self._outside)
        tempfile.tempdir = None
        try:
            yield
        finally:
            _set_env(inside)
            tempfile.tempdir = str(self.directory)

    def _tell(self, line: str) -> None:
        self.start_reaper()
        assert self._reaper is not None and self._reaper.stdin is not None
        self._reaper.stdin.write(line + "\n")
        self._reaper.stdin.flush()

    def _end(self, word: str) -> None:
        if self._reaper is None:  # nothing was started: only the directory
            shutil.rmtree(self.directory, ignore_errors=True)
            return
        assert self._reaper.stdin is not None
        try:
            self._reaper.stdin.write(word + "\n")
            self._reaper.stdin.close()
        except OSError:
            pass  # the reaper is gone already: nothing more to tell it
        try:
            self._reaper.wait(_REAPER_WAIT_S)
        except subprocess.TimeoutExpired:
            pass  # it goes on without us; the command need not wait for it


_current: list[Job] = []  # the job this process runs, while in a scope


def current_job() -> Job | None:
    """The job this process runs now, or None outside every scope."""
    return _current[-1] if _current else None


@contextlib.contextmanager
def job_scope() -> Iterator[Job]:
    """Run the block as one job (see the module doc), or as part of the job already running here.

    Leaving the outermost scope ends the job: on an exception (a signal turned into one included),
    every process of the job still running is killed before the exception goes on; on a normal
    exit only the directory is removed (what the job started has ended).
    """
    if _current:
        _current[-1].start_reaper()
        yield _current[-1]
        return
    _remove_stale(Path(tempfile.gettempdir()))
    directory = Path(tempfile.mkdtemp(prefix=_PREFIX + _owner_name(os.getpid())))
    outside = {name: os.environ.get(name) for name in (JOB_ENV, "TMPDIR", _INDUCTOR)}
    job = Job(uuid.uuid4().hex[:16], directory, outside)
    saved_tempdir = tempfile.tempdir
    # torch.compile caches under the temp dir by default: keep it where it was, or every job would
    # delete it and every run compile cold
    cache = os.environ.get(_INDUCTOR) or os.path.join(tempfile.gettempdir(), f"torchinductor_{_user()}")
    _set_env({JOB_ENV: job.id, "TMPDIR": str(directory), _INDUCTOR: cache})
    tempfile.tempdir = str(directory)
    _current.append(job)
    try:
        yield job
    except BaseException:
        job._end(reaper.ABORT)
        raise
    else:
        job._end(reaper.DONE)
    finally:
        _current.pop()
        tempfile.tempdir = saved_tempdir
        _set_env(job._outside)


def _set_env(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _owner_name(pid: int) -> str:
    """`PID-START-` (START: when the process started), or `PID-` where that cannot be read."""
    start = reaper.process_start_time(pid)
    return f"{pid}-" if start is None else f"{pid}-{start}-"


def _remove_stale(tmp: Path) -> None:
    """Remove the job directories in `tmp` whose command is gone (it died before its reaper started)."""
    for path in tmp.glob(f"{_PREFIX}*-*"):
        if _owner_gone(path.name[len(_PREFIX) :]) and path.is_dir() and path.stat().st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)


def _owner_gone(name: str) -> bool:
    """Whether the command named in a job directory's name (`PID-START-XXXX` or `PID-XXXX`) is gone.

    With its start time, the pid alive but started at another time is another process (pid reuse);
    a name without one is judged by the pid alone."""
    parts = name.split("-")
    if not parts[0].isdigit():
        return False
    pid = int(parts[0])
    if len(parts) >= 3 and parts[1].isdigit():
        return reaper.process_start_time(pid) != int(parts[1])
    return not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _user() -> str:
    """The user name torch's inductor puts in its default cache directory's name."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container): inductor falls back the same way
        return "unknown"
