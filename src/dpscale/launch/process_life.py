"""How the processes dpscale starts live and end: with their launcher, on request, without a crash at exit.

- `die_with_parent`: a worker must not outlive the launcher that started it (a `kill -9` of
  `dpscale train` would otherwise leave workers training and writing checkpoints that a later
  `--resume` reads while they change). Linux's PR_SET_PDEATHSIG has the kernel kill the worker
  when its parent dies; a watchdog thread that sees the parent change covers systems without it.
  `dpscale train`'s workers, `dpscale run`/`scale`'s (run_child.py) and the ranks across hosts
  (hosts.py) call it. The lab's ranks (lab/multirank.py) take only the parent-death signal
  (`set_parent_death_signal`): a watchdog thread would be a second thread in a rank that must
  hold only its own (tests/lab/test_multirank.py), and the job's reaper (job.py) covers the rest.
- `guarded_module`: how the lab's benches across hosts start torchrun as a child (every command's
  own workers come from the agent in the command's process, agent.py):
  `python -m dpscale.launch.process_life PID MODULE ARGS`
  runs `python -m MODULE ARGS` after `die_with_parent(PID)`, so the agent ends with the command
  that started it, whatever the signal, and its workers end with the agent.
- `interrupt_on_signals`: a command's first line of defence, from its start: SIGTERM, SIGINT,
  SIGHUP and SIGUSR1 raise `Interrupted` in its main thread, so the command ends the processes
  it started (job.py) and says in one line what stopped it, instead of dying silently. Until
  then the command's entry point holds those signals (src/_dpscale_cli.py), and
  `release_held_signals` lets them through.
- `StopRequest`: SIGTERM (what a preempting scheduler sends), SIGUSR1 (what SLURM's
  `--signal=USR1@T` sends ahead of a job's end) and SIGINT (Ctrl-C) to the launcher
  become a request that the training loop honours at the next step boundary, after a checkpoint,
  instead of an exception in the middle of a collective. A second signal ends the run at once.
  Workers keep the default SIGTERM (end now): the agent also uses it to stop the survivors of a
  failure before a restart, and those may be stuck in a collective with a dead peer.
- `exit_now`: after a clean finish, flush and leave with `os._exit`, skipping interpreter teardown,
  where a gloo thread that torch still holds (torch._dynamo keeps the process group referenced
  past destroy_process_group) can need the GIL while Python finalizes and abort the process.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import runpy
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_PR_SET_NAME = 15
# how often the watchdog looks at its parent: the worker is gone within this after the launcher
_WATCH_INTERVAL_S = 0.5

# exit codes of a run that stopped on purpose (the launcher and the worker use the same)
EXIT_DIVERGED = 3


def die_with_parent(parent_pid: int) -> None:
    """End this process (SIGKILL) as soon as `parent_pid`, its parent, is gone.

    SIGKILL because a worker whose launcher died has nobody to report to; checkpoints are written
    atomically, so no kill leaves a partial one.
    """
    set_parent_death_signal()
    # the parent may have died before prctl took effect: then we are already someone else's child
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(
        target=_watch_parent, args=(parent_pid,), name="dpscale-parent-watch", daemon=True
    ).start()


def set_parent_death_signal() -> None:
    """Have the kernel SIGKILL this process when its parent ends (Linux's PR_SET_PDEATHSIG; no
    thread). Elsewhere nothing: `die_with_parent`'s watchdog thread is then the only guard."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def set_process_name(name: str) -> None:
    """Name this process `name` (its first 15 bytes) where `top`, `ps -o comm` and /proc/PID/comm
    show it (Linux's PR_SET_NAME); elsewhere nothing. For a process whose command line says little
    of what it is, as a worker forked from a server (fork_start.py)."""
    _prctl(_PR_SET_NAME, name.encode()[:15])


def _prctl(option: int, arg: object) -> None:
    """Linux's prctl(option, arg); elsewhere (or without prctl) nothing."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(option, arg, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # no prctl here


def parent_of(pid: int) -> int | None:
    """The parent of process `pid` (Linux, from /proc), or None where it cannot be read."""
    try:
        # field 4 of /proc/PID/stat; the name (field 2) may hold spaces
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(_WATCH_INTERVAL_S)
        if os.getppid() != parent_pid:  # re-parented: the launcher is gone
            os.kill(os.getpid(), signal.SIGKILL)


class Interrupted(BaseException):
    """A signal ended the command (BaseException: no `except Exception` on the way swallows it)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


INTERRUPTING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)


def interrupt_on_signals() -> dict[int, Any]:
    """From now on, SIGTERM, SIGINT, SIGHUP and SIGUSR1 raise `Interrupted` (main thread only).

    Returns the handlers they had, for `restore_signals`."""
    return {sig: signal.signal(sig, _interrupt) for sig in INTERRUPTING}


def release_held_signals() -> None:
    """Let through the INTERRUPTING signals that the `dpscale` command's entry point held while the
    command started (src/_dpscale_cli.py): one that came meanwhile is delivered now, to the
    handler in place. Call it where that handler's exception is caught, after interrupt_on_signals."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, INTERRUPTING)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """While the block runs, an INTERRUPTING signal is noted and raised as `Interrupted` only once
    the block is done (main thread only): for a step that must not be cut in half, such as starting
    the workers' server, which an exception between its start and its pid being kept would leave
    running with nobody to end it, or importing torch (cli/main.py). Not a blocked mask: the
    processes the block starts inherit that."""
    if threading.current_thread() is not threading.main_thread():  # signal.signal would refuse
        yield
        return
    noted: list[int] = []
    previous: dict[int, Any] = {
        sig: signal.signal(sig, lambda signum, frame: noted.append(signum)) for sig in INTERRUPTING
    }
    try:
        yield
    finally:
        restore_signals(previous)
    if noted:
        raise Interrupted(noted[0])


def restore_signals(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _interrupt(signum: int, frame) -> None:
    raise Interrupted(signum)


class StopRequest:
    """Turns SIGTERM, SIGUSR1 and SIGINT into a request to stop at the next step boundary.

    Call it to learn the request: the signal's name ("SIGTERM", "SIGINT"), or None. Install from
    the main thread (Python runs signal handlers there only).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, on_request=None, on_second=None) -> None:
        """`on_request(name)` runs on the first signal; `on_second(signum)` on another (default: die)."""
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}  # what signal.signal returned: a handler, or SIG_DFL ...
        self._on_request = on_request
        self._on_second = on_second

    def install(self) -> StopRequest:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            # asked twice: the user means now (no checkpoint)
            if self._on_second is not None:
                self._on_second(signum)
                return
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        if self._on_request is not None:
            self._on_request(signal.Signals(signum).name)

    def __call__(self) -> str | None:
        return None if self.signum is None else signal.Signals(self.signum).name


def signal_exit_code(name: str) -> int:
    """The shell's code for a process ended by signal `name`: 128 + its number (SIGTERM 143, SIGINT 130,
    SIGUSR1 138)."""
    return 128 + int(signal.Signals[name])


def exit_now(code: int | None) -> None:
    """Flush stdio and end the process with `code`, skipping interpreter teardown (see module doc).

    None means success, as for `sys.exit`: torch's `@record` returns None when `main` exits with
    SystemExit(0), e.g. after `--help`."""
    code = 0 if code is None else code
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def guarded_module(module: str, *args: str) -> list[str]:
    """The command line that runs `python -m module args` as a child that dies with this process."""
    return [sys.executable, "-m", "dpscale.launch.process_life", str(os.getpid()), module, *args]


def _run_guarded(argv: list[str]) -> None:
    parent, module, *args = argv
    die_with_parent(int(parent))
    sys.argv = [module, *args]  # runpy replaces argv[0] with the module's path, as `python -m` does
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _run_guarded(sys.argv[1:])
