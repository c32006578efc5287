"""The one way dpscale starts workers: torch's elastic agent, run in this process.

`dpscale train` (launcher.py), `dpscale run` and `scale` (run.py), on one host or as one host of a
job across several (nodes.py), all describe their workers as an `AgentSpec` and hand it to
`run_agent`. It starts the agent (torch.distributed.launcher, what torchrun runs) the same way for
all of them:

- where: on one host, dpscale's loopback rendezvous (both stores on 127.0.0.1, a port the OS
  picks; rendezvous.py); across hosts, torchrun's multi-node rendezvous with what the user named
  (`dpscale-c10d`, or torch's static rendezvous with `--node-rank`, its store bound to the
  endpoint's address);
- as one job (job.py): its reaper starts before the first worker, so that the workers and every
  temp file go whatever ends the command, SIGKILL included;
- with dpscale's signal handling: SIGTERM, SIGINT, SIGHUP and SIGUSR1 to this process stop the
  workers (passing SIGTERM, SIGINT and SIGHUP on to them, SIGTERM for SIGUSR1, then SIGKILL after
  `SHUTDOWN_S`) and raise `Interrupted`, which the command turns into one line and 128 + the
  signal. `first_signal` (train's stop request) takes the first SIGTERM, SIGINT or SIGUSR1 instead.
- a worker stopped for good is killed past `stopped_limit_s` (stopped_workers.py);
- the workers' environment is this process's, with `env` on top, only while they run; their
  output goes to this terminal, or all of it (theirs and the agent's) to `log_path`.

Why in this process and not a `torchrun` subprocess (docs/architecture.md): the agent's
exceptions (a worker's failure, a lost host, a signal) arrive here as Python objects to turn into
dpscale's messages and exit codes; there is one process between the command and its workers, so a
terminal's Ctrl-C reaches the agent once; the workers' parent is the command itself, so they die
with it (process_life.die_with_parent).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpscale.launch import fork_start, rendezvous
from dpscale.launch.job import job_scope
from dpscale.launch.nodes import Nodes
from dpscale.launch.process_life import INTERRUPTING, Interrupted
from dpscale.launch.stopped_workers import StoppedWorkers

# after a signal (train: a second one), how long the agent lets workers end before SIGKILL
SHUTDOWN_S = 5
# a signal the agent passes on to the workers as it is (a script may save on SIGTERM); others become SIGTERM
_PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# what a stop request (`first_signal`) may take
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
# left to torch's own handler: it stops the workers and raises, as for ours
_TORCH_SIGNALS = "SIGQUIT"


@dataclass(frozen=True, kw_only=True)
class AgentSpec:
    """The workers one host starts, and how."""

    nproc: int
    """workers on this host"""
    args: tuple[str, ...]
    """each worker runs `python ARGS` (with RANK, LOCAL_RANK, WORLD_SIZE and MASTER_* set)"""
    nodes: Nodes | None = None
    """a job across hosts (this host's part of it); None: this host alone"""
    max_restarts: int = 0
    """restart every worker up to this many times after a failure"""
    collective_timeout_s: float = 60.0
    """across hosts: bounds each call to the rendezvous store and the wait for hosts to rejoin"""
    stopped_limit_s: float | None = None
    """kill a worker that stayed stopped (SIGSTOP) this long; None: never"""
    env: Mapping[str, str | None] = field(default_factory=dict)
    """set in the workers' environment (None: removed from it)"""
    log_path: Path | None = None
    """where the workers' and the agent's output go (truncated first); None: this terminal"""
    first_signal: Callable[[str], object] | None = None
    """takes the first SIGTERM, SIGINT or SIGUSR1 (its name) instead of stopping the workers"""
    forked: bool = False
    """args are `[-u] -m MODULE ARGS` of dpscale's own: fork each worker from the preloaded server
    and run MODULE.forked(*ARGS) there (fork_start.py), instead of starting `python -m MODULE ARGS`"""


def run_agent(spec: AgentSpec) -> dict[int, Any]:
    """Start the workers and wait for them; the agent's result (local rank -> return value).

    Raises torch's ChildFailedError when every attempt failed, `Interrupted` when a signal stopped
    the workers, and the rendezvous' errors across hosts (rendezvous.HostsLost, ...).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.launcher.api import elastic_launch

    forked = spec.forked and fork_start.enabled()
    launch_cfg = _launch_config(spec, forked)
    if forked:
        fork_start.start_server(spec.args[spec.args.index("-m") + 1])  # a no-op where the command started it
    stopped = (
        StoppedWorkers(spec.stopped_limit_s, launch_cfg.run_id, fork_start.server_pid() if forked else None)
        if spec.stopped_limit_s is not None
        else contextlib.nullcontext()
    )
    with (
        job_scope() as job,
        _environment(spec.env),
        _output(spec.log_path),
        _Signals(spec.first_signal) as signals,
    ):
        job.start_reaper()  # before the agent starts workers, also where this is the outermost scope
        if forked:
            entrypoint: Any = fork_start.entry
            module = spec.args.index("-m") + 1
            # the module, its arguments; the environment, the job's included; where output goes
            # (a forked worker's file descriptors 1 and 2 are the server's, not the log set up now)
            args: tuple = (
                spec.args[module],
                dict(os.environ),
                spec.args[module + 1 :],
                None if spec.log_path is None else str(spec.log_path),
            )
        else:
            entrypoint, args = sys.executable, spec.args
        semaphores = fork_start.SemaphoreWatch(job) if forked else contextlib.nullcontext()
        try:
            with stopped, semaphores:
                return elastic_launch(launch_cfg, entrypoint)(*args)
        except SignalException as e:  # the agent stopped the workers: say which signal stopped us
            raise Interrupted(signals.stopped_by or e.sigval) from None


def _launch_config(spec: AgentSpec, forked: bool):
    from torch.distributed.launcher.api import LaunchConfig

    nodes = spec.nodes
    where: dict[str, Any]
    if nodes is None:  # one host: stores on 127.0.0.1 only
        where = dict(
            min_nodes=1,
            max_nodes=1,
            run_id=f"dpscale-{uuid.uuid4().hex[:8]}",
            rdzv_backend=rendezvous.register(),
            rdzv_endpoint=f"{rendezvous.LOOPBACK}:0",
        )
    else:  # what the user named, nothing else (see nodes.py)
        where = dict(
            min_nodes=nodes.min_nodes,
            max_nodes=nodes.max_nodes,
            run_id=nodes.rdzv_id,
            rdzv_backend=rendezvous.MULTI_HOST_BACKEND
            if nodes.node_rank is None
            else rendezvous.register_static(),
            rdzv_endpoint=nodes.rdzv_endpoint,
            rdzv_configs=nodes.rdzv_configs(spec.collective_timeout_s),
            local_addr=nodes.local_addr,
        )
    # torch 2.11's LaunchConfig has no shutdown_timeout: there the agent waits its own 30 s
    # between SIGTERM and SIGKILL of a worker that does not stop
    if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}:
        where["shutdown_timeout"] = SHUTDOWN_S
    return LaunchConfig(
        **where,
        nproc_per_node=spec.nproc,
        max_restarts=spec.max_restarts,
        monitor_interval=0.1,
        signals_to_handle=_TORCH_SIGNALS,  # the others are ours (_Signals)
        start_method="forkserver" if forked else "spawn",  # "spawn" is torch's default (unused for a binary)
    )


@contextlib.contextmanager
def _environment(env: Mapping[str, str | None]) -> Iterator[None]:
    """`env` on top of os.environ (which torch copies into each worker's), restored afterwards."""
    before = {name: os.environ.get(name) for name in env}
    _set_env(env)
    try:
        yield
    finally:
        _set_env(before)


def _set_env(values: Mapping[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@contextlib.contextmanager
def _output(log_path: Path | None) -> Iterator[None]:
    """With a log, this process's stdout and stderr (file descriptors 1 and 2, which the workers
    inherit) point at it while the block runs: the workers' output and the agent's messages."""
    if log_path is None:
        yield
        return
    _flush()
    saved = [os.dup(1), os.dup(2)]
    open(log_path, "w").close()
    try:
        # appended to: forked workers open it themselves (fork_start.entry), and writes at one
        # offset of this process's would overwrite theirs
        with open(log_path, "a") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                yield
            finally:
                _flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
    finally:
        for fd in saved:
            os.close(fd)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


class _Signals:
    """While the agent runs, a signal to this process stops the workers (module doc); `stopped_by`
    is the signal that did. Main thread only (Python runs handlers there); elsewhere the process's
    handlers stay as they are."""

    def __init__(self, first_signal: Callable[[str], object] | None) -> None:
        self._first_signal = first_signal
        self._requested = False  # first_signal took one already
        self.stopped_by: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            # SIGQUIT too: torch installs its own handler for it, and leaves it there
            self._previous = {sig: signal.getsignal(sig) for sig in (*INTERRUPTING, signal.SIGQUIT)}
            for sig in INTERRUPTING:
                signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def _handle(self, signum: int, frame) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if self._first_signal is not None and not self._requested and signum in _STOP_SIGNALS:
            self._requested = True
            self._first_signal(signal.Signals(signum).name)
            return
        if self.stopped_by is not None:
            return  # the workers are being stopped already (within SHUTDOWN_S)
        self.stopped_by = signum
        passed = signum if signum in _PASSED_ON else signal.SIGTERM
        # the agent's own way out: it stops the workers (that signal, then SIGKILL) and re-raises
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(passed))
