"""Start the training workers: in this process for one worker, through torch's elastic agent for more.

The agent is dpscale's one launcher core (agent.py, shared with `dpscale run` and `scale`): it
does the rendezvous (on one host on 127.0.0.1 with a port the OS picks), restarts every worker
when one fails (up to `max_restarts`), and hands each worker its rank through the environment. A
restarted worker resumes from the last good checkpoint. Each worker is a `python -m
dpscale.launch.worker` subprocess of this process (as under torchrun), not a multiprocessing
child: nothing between the launcher and its workers, and no named semaphores in /dev/shm that a
killed job would leave behind. Workers end when the launcher dies (see process_life.py), and the
workers and their temp files (the launch spec, torch elastic's logs) are one job (job.py): a
SIGKILLed launcher leaves nothing behind. SIGTERM, SIGUSR1 or SIGINT to the launcher writes a stop
file the workers look for at every step; they stop after the same step, checkpoint, and `launch`
raises `RunStopped`; a second signal stops them at once. A worker stopped for good (SIGSTOP) is
killed a few seconds after the collective timeout (stopped_workers.py), so the failure is named.

On one host the agent always restarts the same number of workers, so a world size range
`min_nproc..nproc` means: start `nproc`; when every restart at that size has failed, launch again
with the next smaller size whose workers split the global batch, resuming from the last checkpoint
(see docs/fault-tolerance.md for what this can and cannot do).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import tempfile
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dpscale.cores import over_host_cap, usable_cores
from dpscale.errors import ConfigError, UserCodeError
from dpscale.launch import dir_lock, rendezvous
from dpscale.launch.agent import AgentSpec, run_agent
from dpscale.launch.job import job_scope
from dpscale.launch.nodes import Nodes, parse_min_max
from dpscale.launch.preflight import check_before_start, check_run, resume_note
from dpscale.launch.process_life import EXIT_DIVERGED, Interrupted, StopRequest, signal_exit_code
from dpscale.launch.protocol import (
    LAUNCH_SPEC_ENV,
    LAUNCHER_PID_ENV,
    LaunchSpec,
    WorkerFailure,
    read_record,
    refusals,
)
from dpscale.log import get_logger, workers
from dpscale.train.checkpoint.files import remove_checkpoints
from dpscale.train.config import TrainConfig
from dpscale.train.device import backend_for, device_id_for, resolve_device
from dpscale.train.result import TrainResult
from dpscale.train.trainer import Trainer

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

logger = get_logger(__name__)

# a worker stopped this long past the collective timeout is killed: its peers have timed out
# waiting for it by then and written who hung (the failure summary names it from their record)
_STOPPED_GRACE_S = 3


class LaunchError(RuntimeError):
    """Every attempt failed; the message names the failing rank and holds its traceback."""


class _AttemptsFailed(Exception):
    """Every restart at one world size failed; the message is the failure summary."""


class RunStopped(Exception):
    """The run ended early on purpose: diverged (exit code 3) or stopped by a signal (128 + signal).

    The message is one line saying where it stopped; `result` is rank 0's, when it got that far.
    """

    def __init__(self, message: str, exit_code: int, result: TrainResult | None = None):
        super().__init__(message)
        self.exit_code = exit_code
        self.result = result


def stopped_exit_code(stopped_by: str) -> int:
    """Exit code for a run that stopped early: 3 when it diverged, 128 + the signal's number otherwise."""
    if stopped_by == "diverged":
        return EXIT_DIVERGED
    return signal_exit_code(stopped_by) if stopped_by in signal.Signals.__members__ else 128 + signal.SIGTERM


def default_threads(nproc: int) -> int:
    """Intra-op threads per worker: the cores this process may use, split evenly."""
    return max(1, usable_cores() // nproc)


def parse_nproc(text: str) -> tuple[int, int]:
    """`N` or `MIN:MAX` -> (min_nproc, nproc)."""
    return parse_min_max("--nproc", text)


def launch(
    cfg: TrainConfig,
    nproc: int,
    *,
    min_nproc: int | None = None,
    max_restarts: int = 0,
    threads: int | None = None,
    nodes: Nodes | None = None,
) -> TrainResult:
    """Train with `nproc` workers on this host (down to `min_nproc` if they keep failing); with
    `nodes`, as one host of a multi-host job (the same call on every host; see nodes.py).

    Returns rank 0's result; raises LaunchError when every attempt at every size failed.
    """
    min_nproc = nproc if min_nproc is None else min_nproc
    if not 1 <= min_nproc <= nproc:
        raise ConfigError(f"nproc must be N or MIN:MAX with 1 <= MIN <= MAX, got {min_nproc}:{nproc}")
    if max_restarts < 0:
        raise ConfigError(f"max_restarts must be >= 0, got {max_restarts}")
    # fail before starting anything when the batch does not split (resolve_batch names the numbers);
    # a scale-lr resume with a checkpoint splits the checkpoint's per-worker batch instead
    if not _can_start(cfg, nproc):
        cfg.resolve_batch(nproc)
    if not _splits(cfg, min_nproc):
        cfg.resolve_batch(min_nproc)
    if threads is not None and threads < 1:
        raise ConfigError(f"threads must be >= 1 (intra-op threads per worker), got {threads}")
    for what, value in (("threads", threads or 0), ("nproc", nproc)):
        if refusal := over_host_cap(what, value):
            raise ConfigError(refusal)
    check_before_start(cfg)
    if nodes is not None and min_nproc != nproc:
        raise ConfigError("--nproc MIN:MAX is for one host; across hosts give --nnodes MIN:MAX and --nproc N")
    if nodes is not None and nodes.node_rank is not None and max_restarts:
        # a static rendezvous has no round every host shares, so restarted hosts would meet under
        # different keys (comm/attempt.py)
        raise ConfigError(
            "--node-rank (static rendezvous) cannot restart across hosts: drop --node-rank (the "
            "dpscale-c10d rendezvous numbers the hosts and restarts them) or give --max-restarts 0"
        )
    # the lock belongs to the job: across hosts (one shared directory) the store's host holds it,
    # so a second job is refused there and the other hosts of one job do not refuse each other
    lock = cfg.checkpoint.dir if nodes is None or nodes.serves_store() else None
    with dir_lock.hold(lock) if lock else contextlib.nullcontext():
        if note := resume_note(cfg):
            logger.info("%s", note)
        cfg, trusted = _settle_run(cfg, nodes, holds_lock=lock is not None)
        if nodes is not None:
            return _launch_nodes(cfg, nproc, max_restarts, threads or default_threads(nproc), nodes, trusted)
        return _launch_sizes(cfg, nproc, min_nproc, max_restarts, threads, trusted)


def _settle_run(
    cfg: TrainConfig, nodes: Nodes | None, *, holds_lock: bool
) -> tuple[TrainConfig, dict | None]:
    """Which run this launch is (preflight.check_run): the workers get its id, so that a restart
    resumes this run's checkpoints and pruning deletes only those; with start_over the directory's
    checkpoints go first (by the host that holds its lock). Also the checkpoint verified for a
    resume, which rank 0 then does not hash again."""
    run_id, trusted = check_run(cfg, nodes.rdzv_id if nodes is not None else None)
    if cfg.checkpoint.start_over and holds_lock and cfg.checkpoint.dir:
        if removed := remove_checkpoints(cfg.checkpoint.dir):
            logger.info("--start-over: deleted %d checkpoint(s) in %s", removed, cfg.checkpoint.dir)
    # start_over is done: a restart, which resumes, must not see it
    return replace(cfg, checkpoint=replace(cfg.checkpoint, run_id=run_id, start_over=False)), trusted


def _launch_nodes(
    cfg: TrainConfig, nproc: int, max_restarts: int, threads: int, nodes: Nodes, trusted: dict | None
):
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    try:
        return _finished(_launch_elastic(cfg, nproc, max_restarts, threads, nodes, trusted))
    except _AttemptsFailed as e:
        raise LaunchError(str(e)) from None
    except rendezvous.HostsLost as e:  # this host is cut off: the message names whom it lost
        raise LaunchError(f"{e}; this host's workers were stopped") from None
    except rendezvous.HostsDidNotRejoin as e:  # after a restart, the lost hosts never came back
        raise LaunchError(str(e)) from None
    except RendezvousConnectionError:
        # the agent's store calls time out (read_timeout) when this host is cut off from the store's
        waited_s = nodes.read_timeout_s(cfg.engine.collective_timeout_s)
        raise LaunchError(
            f"lost the rendezvous store at {nodes.rdzv_endpoint} (host {nodes.endpoint_host}): it closed "
            f"the connection or did not answer within {waited_s} s, "
            "so that host ended, is gone or is cut off from this one; this host's workers were stopped"
        ) from None


def _launch_sizes(
    cfg: TrainConfig,
    nproc: int,
    min_nproc: int,
    max_restarts: int,
    threads: int | None,
    trusted: dict | None = None,
):
    if nproc == 1 and max_restarts == 0:
        return _finished(_run_in_process(cfg, threads or default_threads(1), trusted))
    n = nproc
    while True:
        try:
            return _finished(
                _launch_elastic(cfg, n, max_restarts, threads or default_threads(n), None, trusted)
            )
        except _AttemptsFailed as e:
            failure = str(e)
            # a fresh agent counts restarts from 0, so resuming must be asked for explicitly
            cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, resume=bool(cfg.checkpoint.dir)))
            smaller = (m for m in range(n - 1, min_nproc - 1, -1) if _can_start(cfg, m))
            fewer = next(smaller, None)
            if fewer is None:
                raise LaunchError(failure) from None
            n = fewer
            logger.warning("%s; launching again with %s", failure.splitlines()[0], workers(n))


def _splits(cfg: TrainConfig, n: int) -> bool:
    """Whether n workers may be asked for: the configured batch splits, or scale-lr may take a
    checkpoint's per-worker batch (whether one exists is known only when it comes to it)."""
    if cfg.checkpoint.world_change == "scale-lr" and cfg.checkpoint.dir:
        return True
    return _configured_split(cfg, n)


def _can_start(cfg: TrainConfig, n: int) -> bool:
    """Whether n workers can start now: the configured batch splits, or a scale-lr resume has a checkpoint."""
    if cfg.checkpoint.world_change == "scale-lr" and cfg.checkpoint.resume and cfg.checkpoint.dir:
        if any(Path(cfg.checkpoint.dir).glob("step-*")):
            return True
    return _configured_split(cfg, n)


def _configured_split(cfg: TrainConfig, n: int) -> bool:
    try:
        cfg.resolve_batch(n)
    except ValueError:
        return False
    return True


def _finished(result: TrainResult) -> TrainResult:
    if result.stopped_by:
        raise RunStopped(
            result.stop_message or result.stopped_by, stopped_exit_code(result.stopped_by), result
        )
    return result


def _launch_elastic(
    cfg: TrainConfig,
    nproc: int,
    max_restarts: int,
    threads: int,
    nodes: Nodes | None = None,
    trusted: dict | None = None,
) -> TrainResult:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # the spec's directory inside the job's (job.py): a SIGKILLed launcher leaves neither
    with job_scope(), tempfile.TemporaryDirectory(prefix="dpscale-launch-") as tmp:
        spec = LaunchSpec.in_dir(tmp, config=cfg.to_dict(), threads=threads, trusted_checkpoint=trusted)
        spec_path = Path(tmp) / "spec.json"
        spec.write(spec_path)
        agent = AgentSpec(
            nproc=nproc,
            args=("-m", "dpscale.launch.worker"),
            nodes=nodes,
            max_restarts=max_restarts,
            collective_timeout_s=cfg.engine.collective_timeout_s,
            stopped_limit_s=cfg.engine.collective_timeout_s + _STOPPED_GRACE_S,
            env={
                LAUNCH_SPEC_ENV: str(spec_path),
                LAUNCHER_PID_ENV: str(os.getpid()),
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
            },
            # the first SIGTERM, SIGUSR1 or SIGINT asks the workers to stop after a step
            first_signal=Path(spec.stop).write_text,
            forked=True,  # from the server the command started (fork_start.py)
        )
        try:
            run_agent(agent)
        except ChildFailedError as e:  # the failure records live in `tmp`: read them before it goes
            _raise_refusal(spec.failures)
            raise _AttemptsFailed(_describe_failure(e, nproc, max_restarts, spec.failures)) from None
        except Interrupted as e:  # a second signal (or SIGHUP, SIGQUIT): the workers were ended
            raise RunStopped(f"stopped by {e.name} at once, without a checkpoint", e.exit_code) from None
        _raise_refusal(spec.failures)
        result = _read_result(spec.result)
    if result is None:
        raise LaunchError(f"training with {nproc} workers ended without a result from rank 0")
    return result


def _raise_refusal(failures_dir: str) -> None:
    """A worker refused its input (protocol.py): that is bad input, one line and exit 2, as if the
    launcher had found it before starting, and no restart."""
    if found := refusals(failures_dir):
        raise UserCodeError(found[0].bad_input, found[0].user_traceback)


def _read_result(path: str) -> TrainResult | None:
    record = read_record(path)
    try:
        return TrainResult(**record) if record is not None else None
    except TypeError:
        return None


def _describe_failure(e: ChildFailedError, nproc: int, max_restarts: int, failures_dir: str) -> str:
    """First line: what failed, naming the rank to look at; then the first failing worker's traceback.

    A rank that hung is what to look at, not the rank that timed out waiting for it (which fails
    first); the timed-out rank's failure record (protocol.WorkerFailure) names it. A worker killed
    by a signal leaves no error record (torch's file holds "<NONE>"), only its exit code.
    """
    attempts = f"{max_restarts + 1} attempt{'s' if max_restarts else ''}"
    head = f"training with {nproc} workers failed after {attempts} (--max-restarts {max_restarts}); "
    try:
        rank, failure = e.get_first_failure()
    except Exception:  # the agent's error record is best effort; never hide the failure behind it
        return f"training with {nproc} workers failed after {attempts}: {e}"
    message = failure.error_file_data.get("message") if isinstance(failure.error_file_data, dict) else None
    record = message if isinstance(message, dict) else {}
    info = record.get("extraInfo")
    extra = info if isinstance(info, dict) else {}
    trace = str(extra.get("py_callstack") or "")
    written = WorkerFailure.read(failures_dir, rank, failure.pid)
    hung = written.silent_ranks if written is not None else []
    if hung:
        who = ", ".join(f"rank {r}" for r in hung)
        head += f"{who} hung: rank {rank} timed out waiting for it in a collective"
    elif failure.exitcode == -signal.SIGABRT and (running := _still_running(e, rank, failure, nproc)):
        # NCCL's watchdog aborts a rank whose collective timed out before dpscale's diagnosis can
        # run (no record then); the ranks of this host the agent still had to stop were the late ones
        who = ", ".join(f"rank {r}" for r in running)
        head += (
            f"{who} hung: rank {rank} was aborted (SIGABRT, as NCCL's watchdog does when a collective "
            f"times out) while {who} still ran"
        )
    elif failure.exitcode < 0:
        signal_no, name = -failure.exitcode, failure.signal_name()
        head += f"last failure: rank {rank} was killed by signal {signal_no} ({name})"
    else:
        head += f"last failure: rank {rank} exited with code {failure.exitcode}"
    return head + (":\n" + trace.rstrip() if trace else "")


def _still_running(e: ChildFailedError, rank: int, failure: Any, nproc: int) -> list[int]:
    """The ranks on this host that had not failed when the agent stopped the workers (global ranks
    of one host are consecutive: its local rank 0 is rank - local_rank)."""
    first = rank - failure.local_rank
    return [r for r in range(first, first + nproc) if r not in e.failures]


def _run_in_process(cfg: TrainConfig, threads: int, trusted: dict | None = None) -> TrainResult:
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    device = resolve_device(cfg.device, local_rank=0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # the collective timeout too: an in-process run still issues collectives (NCCL's at world size 1)
    dist.init_process_group(
        backend_for(device),
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=cfg.engine.collective_timeout_s),
        device_id=device_id_for(device),
    )
    # signal handlers can only be installed from the main thread (an API caller may be elsewhere)
    stop = StopRequest().install() if threading.current_thread() is threading.main_thread() else None
    try:
        return Trainer(cfg, stop_requested=stop, trusted_checkpoint=trusted).fit()
    finally:
        if stop is not None:
            stop.restore()
        dist.destroy_process_group()
        torch.set_num_threads(old)
