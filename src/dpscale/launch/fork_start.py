"""The workers of `dpscale train`, `run` and `scale` forked from a server that imported torch once.

A worker started as `python -m dpscale.launch.worker` first imports torch and dpscale: 3-4 s of
one core on a small host, paid by every worker, again by every restart, and only after the command
has imported torch itself. Instead the command starts multiprocessing's fork server as soon as it
knows it will start workers (`start_server`), so that the server imports the worker's modules on
the other core while the command imports its own; torch's agent (start_method "forkserver") then
forks each worker from it, a restart's too, in milliseconds (BENCHMARKS.md, "Starting workers").

What a worker sees stays what `python -m dpscale.launch.worker` saw:
- its environment: the launcher's as it is when the workers start (`entry` replaces the server's,
  which is the launcher's from when the server started), with the agent's variables on top (torch
  sets them in the child before `entry` runs: they are what differs from the server's);
- its end with the launcher: its parent is the server, which ends when the command does (its
  end of the pipe closes, SIGKILL included), and the worker dies with its parent
  (worker.forked -> process_life.die_with_parent); the job's reaper also ends the server on an
  abnormal end. The server is the process's one forkserver, which the lab's ranks share
  (lab/multirank.py): it starts outside the job, as theirs does, and serves later launches too;
- its exit code: what the worker returns or exits with. Two ways of ending that
  torch.multiprocessing would turn into a silent 0, without the result torch's agent waits for
  (it would wait for ever), are exit codes instead: Ctrl-C (KeyboardInterrupt) is 130 and a
  sys.exit(0) from inside is 1.

`dpscale run`/`scale` fork their workers the same way (run_child.forked), and there the script
runs as a fresh interpreter runs it (script_main.py). A run with a log of its own (`scale`'s) has
each forked worker open the log itself (`entry`'s log_path): its file descriptors are the server's.
`DPSCALE_WORKER_START=exec` starts every worker as `python -m MODULE` (the fallback, and for comparison).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import multiprocessing
import multiprocessing.util
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Mapping, Sequence
from multiprocessing import forkserver, resource_tracker

START_ENV = "DPSCALE_WORKER_START"
# what the server of `dpscale train` imports before it forks anything: this module first (its
# _SERVER_ENV is the server's environment), then torch, torch._dynamo (torch's optimizers import
# it on their first parameter group: ~1.2 s of CPU in each process that builds one), dpscale's
# engine, trainer and worker (`dpscale` imports its public names on first use). None of them (nor
# of SCRIPT_PRELOAD's) starts a thread, so a forked process is as clean as a spawned one. The lab's
# ranks use this list too (lab/multirank.py): a process has one forkserver, and whichever starts
# it sets its preload.
PRELOAD = [
    "dpscale.launch.fork_start",
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "dpscale",
    "dpscale.engine",
    "dpscale.train.trainer",
    "dpscale.launch.worker",
    "dpscale.launch.run_child",
]
# what the server of `dpscale run` and `scale` imports: not dpscale's trainer, nor torch._dynamo,
# which a script without an optimizer never imports: the first fork waits for the whole list, and
# for a script that only imports torch, torch._dynamo cost more CPU than an exec'd worker's whole
# start (BENCHMARKS.md, "Starting workers": a script's); a script's optimizer imports it in the worker
SCRIPT_PRELOAD = [
    "dpscale.launch.fork_start",
    "torch",
    "torch.distributed",
    "dpscale",
    "dpscale.engine",
    "dpscale.launch.run_child",
]
# the module each worker runs -> what its server preloads
PRELOADS = {"dpscale.launch.worker": PRELOAD, "dpscale.launch.run_child": SCRIPT_PRELOAD}
_EXIT_INTERRUPTED = 128 + signal.SIGINT

# imported in the server (PRELOAD): its environment before any fork, and that this is so
_SERVER_ENV = dict(os.environ)
_IMPORTED_BY = os.getpid()
_forked = False  # this process is a worker `entry` runs


def forked_worker() -> bool:
    """Whether this process is a worker forked by torch's agent from the server (`entry`)."""
    return _forked


def enabled() -> bool:
    """Whether workers are forked (the default) or started as `python -m` (`exec`)."""
    return os.environ.get(START_ENV, "fork") != "exec"


def start_server(module: str = "dpscale.launch.worker") -> None:
    """Start the process's fork server now, if it is not running, for workers that run `module`
    (it imports PRELOADS[module] meanwhile).

    Inside a job (launch/job.py) the server starts outside it, as the lab's does: it serves this
    process's later launches too, and ends when this process does."""
    if not enabled():
        return
    from dpscale.launch.job import current_job

    multiprocessing.set_forkserver_preload(PRELOADS[module])
    job = current_job()
    if job is None:
        forkserver.ensure_running()
        return
    with job.outside():
        forkserver.ensure_running()
    job.add_path(multiprocessing.util.get_temp_dir())  # the server's socket, should this process die
    if pid := server_pid():
        job.add(pid)  # and the server itself


# the commands whose workers run a user's script (run_child), not dpscale's trainer (worker)
_SCRIPT_COMMANDS = (["run"], ["scale"])


def worker_module(argv: list[str]) -> str:
    """The module the workers of `dpscale ARGV` run (one that `starts_workers`)."""
    return "dpscale.launch.run_child" if argv[:1] in _SCRIPT_COMMANDS else "dpscale.launch.worker"


def starts_workers(argv: list[str]) -> bool:
    """Whether `dpscale ARGV` will start workers: a `run` or `scale` (a script's workers), a `train`
    with more than one worker, restarts, or a job across hosts, read from the flags alone: what
    `dpscale` checks before it imports torch (cli/main.py). A wrong guess costs only time: the
    flags are parsed again, properly."""
    if argv[:1] in _SCRIPT_COMMANDS:
        return not {"-h", "--help"} & set(argv)
    if argv[:1] != ["train"]:
        return False
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument("--nproc", default="1")
    peek.add_argument("--max-restarts", default="0")
    peek.add_argument("--nnodes")
    known, _ = peek.parse_known_args(argv[1:])
    return known.nproc.strip() not in ("1", "1:1") or known.max_restarts.strip() != "0" or bool(known.nnodes)


def stop_server(*, remove_dir: bool = True) -> None:
    """End the server and remove its socket's directory, at the end of the command: its workers
    have ended, and a server still importing (the command refused its input first) would otherwise
    go on for seconds; multiprocessing removes the directory only at an interpreter exit, which
    `dpscale train` skips (process_life.exit_now). `remove_dir=False` before an interpreter exit:
    multiprocessing's exit handler removes it then, and fails on one removed already."""
    pid = server_pid()
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
    if remove_dir:
        shutil.rmtree(multiprocessing.util.get_temp_dir(), ignore_errors=True)


def server_pid() -> int | None:
    """The running fork server's pid (the workers' parent), or None. CPython keeps it in a private
    attribute; without it the server still ends with this process (its pipe closes)."""
    return getattr(forkserver._forkserver, "_forkserver_pid", None)  # noqa: SLF001


def entry(
    module: str, launcher_env: Mapping[str, str], argv: Sequence[str] = (), log_path: str | None = None
) -> int:
    """What each forked worker runs: the launcher's environment with the agent's variables on top,
    its output to `log_path` if one is given, then `module.forked(*argv)`, its exit code made one
    that torch's agent sees (module doc)."""
    global _forked
    _forked = True
    _take_environment(launcher_env)
    if log_path is not None:
        _output_to(log_path)
    try:
        code = importlib.import_module(module).forked(*argv)
    except KeyboardInterrupt:
        raise SystemExit(_EXIT_INTERRUPTED) from None
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        raise SystemExit(code or 1) from None
    if code:
        raise SystemExit(code)
    return 0


class SemaphoreWatch:
    """While torch's agent runs forked workers, hand the job's reaper (launch/job.py) each named
    semaphore this process makes: the agent's queues for the workers' results use multiprocessing's
    (`/dev/shm/sem.mp-*`, one set per attempt). Multiprocessing's resource tracker removes them when
    the job ends, even after `kill -9` of the command, but not when it is killed too (a SIGKILL to
    the job's process group); the reaper, in a session of its own, removes them then.

    The names are taken as multiprocessing registers each with its tracker, before any worker
    exists: a watch of the workers' mappings (what this was first) missed those of a job killed
    within one look of its workers' start, which a forked script's workers reach in well under a
    second. Only this process's `register` is wrapped, and only while the agent runs."""

    def __init__(self, job) -> None:
        self._job = job
        self._register: Callable[..., None] | None = None

    def __enter__(self) -> SemaphoreWatch:
        self._register = resource_tracker.register
        setattr(resource_tracker, "register", self._tell_and_register)  # noqa: B010 (typeshed's types)
        return self

    def __exit__(self, *exc: object) -> None:
        setattr(resource_tracker, "register", self._register)  # noqa: B010

    def _tell_and_register(self, name: str, rtype: str) -> None:
        if rtype == "semaphore":  # "/mp-XXXX" is the file /dev/shm/sem.mp-XXXX (glibc's naming)
            self._job.add_path(semaphore_path(name))
        assert self._register is not None
        self._register(name, rtype)


def semaphore_path(name: str) -> str:
    """Where the named POSIX semaphore `name` lives on Linux."""
    return "/dev/shm/sem." + name.lstrip("/")


def _output_to(log_path: str) -> None:
    """File descriptors 1 and 2 to the end of the run's log, which the command truncated (agent.py)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _take_environment(launcher_env: Mapping[str, str]) -> None:
    if _IMPORTED_BY == os.getpid():
        # not preloaded (a forkserver someone else started): the server's environment is unknown,
        # so the agent's variables cannot be told apart; keep them and add what is missing
        for name, value in launcher_env.items():
            os.environ.setdefault(name, value)
    else:
        agent = {name: value for name, value in os.environ.items() if _SERVER_ENV.get(name) != value}
        os.environ.clear()
        os.environ.update(launcher_env)
        os.environ.update(agent)
    tempfile.tempdir = None  # the launcher's temp dir (TMPDIR, the job's), not the server's
