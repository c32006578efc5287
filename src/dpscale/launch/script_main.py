"""A user's script run in a worker forked from the server (fork_start.py) as `python -u` runs it.

A worker that `dpscale run` or `scale` starts afresh runs `python -u -m dpscale.launch.run_child
SCRIPT ARGS` (run_child.py). A forked one is already a Python process, a child of multiprocessing's
fork server that imported torch; `as_main` makes what a script can see of that the same as in a
fresh interpreter, before and after the script:

- stdout and stderr are unbuffered text streams on file descriptors 1 and 2 (`-u`), not the
  server's; faulthandler is off unless the environment turns it on (torch's `@record` turns it on);
- torch's intra-op threads follow OMP_NUM_THREADS as the worker's environment sets it (torch read
  the server's when it was imported);
- multiprocessing sees the main process of a program (`current_process().name == "MainProcess"`,
  no parent) with the platform's default start method, not the fork server's child it is;
- the end: an exception is printed by sys.excepthook and exits 1, `sys.exit(x)` exits as Python
  exits for x, a KeyboardInterrupt is printed and ends the process by SIGINT (as CPython does);
  then, as at an interpreter's exit, the script's non-daemon threads are joined and its atexit
  handlers run. `os._exit(0)` in the worker (the script's, or run_child's at a step limit) first
  hands torch's agent the worker's result, which a forked worker owes it (torch_private).

What stays different is in docs/architecture.md ("Starting workers").
"""

from __future__ import annotations

import atexit
import faulthandler
import io
import multiprocessing
import multiprocessing.process
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

from dpscale.launch import torch_private

_INTERRUPTED = -1  # as_main's code for a KeyboardInterrupt: the process ends by SIGINT


def as_main(script: Callable[[], object]) -> int:
    """Run `script()` as a fresh interpreter's main program; its exit code (see the module doc)."""
    _fresh_streams()
    _fresh_threads()
    _fresh_multiprocessing()
    _hand_back_on_exit(os.getpid())
    code = _run(script)
    _interpreter_exit()
    if code == _INTERRUPTED:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _run(script: Callable[[], object]) -> int:
    try:
        script()
    except SystemExit as e:
        return _system_exit_code(e.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        return _INTERRUPTED
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def _system_exit_code(code: object) -> int:
    """What CPython exits with for `sys.exit(code)`: None is 0, an int itself, anything else is
    printed to stderr and exits 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stderr.write(f"{code}\n")
    return 1


def _interpreter_exit() -> None:
    """What an interpreter does at its end before it leaves: wait for the non-daemon threads, run
    the atexit handlers (those of the script and of what it imported), flush."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    atexit._clear()  # once only: multiprocessing leaves without them, and a handler may not run twice
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _fresh_streams() -> None:
    """`python -u`'s stdout and stderr: text over the raw file, written through (as CPython builds them)."""
    for name in ("stdout", "stderr"):
        old = getattr(sys, name)
        fd = 1 if name == "stdout" else 2
        raw = io.FileIO(fd, "wb", closefd=False)
        stream = io.TextIOWrapper(
            raw,  # CPython's own -u streams wrap the raw file too
            encoding=getattr(old, "encoding", None),
            errors=getattr(old, "errors", None) or "backslashreplace",
            write_through=True,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    if not (os.environ.get("PYTHONFAULTHANDLER") or "faulthandler" in sys._xoptions):
        faulthandler.disable()


def _fresh_threads() -> None:
    """torch's intra-op threads as a fresh import under this environment would set them."""
    import torch

    try:
        threads = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return  # torch would ignore it too
    if threads > 0 and threads != torch.get_num_threads():
        torch.set_num_threads(threads)


def _fresh_multiprocessing() -> None:
    """multiprocessing as in a program's main process: the platform's default start method (the
    server's child is forced to "forkserver"), the name MainProcess, no parent."""
    multiprocessing.set_start_method(None, force=True)  # None: the default
    me = multiprocessing.current_process()
    me.name = "MainProcess"
    me._identity = ()  # its children are Process-1, ... (not Process-N:1)
    multiprocessing.process._parent_process = None  # type: ignore[attr-defined]


def _hand_back_on_exit(worker_pid: int) -> None:
    """Have os._exit(0) in this worker (not in its forked children) hand the agent its result first."""
    exit_now = os._exit

    def _exit(status: int) -> NoReturn:
        if status == 0 and os.getpid() == worker_pid:
            torch_private.hand_back_result(None)
        exit_now(status)

    os._exit = _exit
