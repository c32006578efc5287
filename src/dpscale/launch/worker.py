"""`torchrun ... -m dpscale.launch.worker --workload digits ...`: the training worker under plain torchrun.

Takes the same flags as `dpscale train` except the launcher's own (--nproc, --max-restarts);
rank 0 prints the result as one JSON line when --json is given. Under `torchrun --nnodes MIN:MAX`
the world size may change between restarts; the trainer then keeps the global batch (see
docs/fault-tolerance.md). Rank 0 warns when the rendezvous address (MASTER_ADDR) is not loopback.
`dpscale train` starts this same module, with its task in a file the environment names.

Either way the worker dies with the process that started it (the agent, or under `dpscale train`
the server the agent forks workers from: `forked`, launch/fork_start.py), exits 3 when the run
diverged (under torchrun; `dpscale train` reports it from the result), and leaves through
os._exit after a clean finish (see process_life.py; a forked worker returns, and multiprocessing
leaves through os._exit for it). Under `dpscale train` it also stops after a
step when the launcher's stop file appears (the launcher got SIGTERM/SIGINT); SIGTERM to the worker
itself ends it at once, as under torchrun, whose agent sends it to stop workers for a restart.

`run_worker` is what every worker does, however started: join the group the agent (or torchrun)
describes in the environment, over its store with a prefix per restart attempt, then train.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from dpscale.comm.attempt import attempt_id, gloo_interface_hint, is_restart, publish_host
from dpscale.cores import over_host_cap
from dpscale.engine.collective_log import CollectiveError
from dpscale.errors import ConfigError, UserCodeError
from dpscale.flags import add_dataclass_arguments, dataclass_kwargs
from dpscale.launch import torch_private
from dpscale.launch.nodes import rendezvous_warning
from dpscale.launch.process_life import EXIT_DIVERGED, die_with_parent, exit_now, parent_of, set_process_name
from dpscale.launch.protocol import (
    LAUNCH_SPEC_ENV,
    LAUNCHER_PID_ENV,
    LaunchSpec,
    WorkerFailure,
    write_atomically,
)
from dpscale.launch.refusal_watch import USER_EXIT, RefusalWatch, store_for_attempt
from dpscale.log import get_logger
from dpscale.train.callbacks import callbacks_from_env
from dpscale.train.config import TrainConfig
from dpscale.train.device import backend_for, device_id_for, resolve_device
from dpscale.train.trainer import Trainer

logger = get_logger(__name__)


def run_worker(
    config: dict,
    threads: int,
    stop_requested=None,
    trusted_checkpoint: dict | None = None,
    failures_dir: str | None = None,
) -> dict:
    """One worker: join the group the agent (or torchrun) describes in the environment, train.
    `trusted_checkpoint`: what the launcher verified for a resume (LaunchSpec); `failures_dir`:
    where the launcher reads the workers' records, given when a refusal of one rank's input is to
    end every rank (refusal_watch.py)."""
    torch.set_num_threads(threads)
    cfg = TrainConfig.from_dict(config)
    if is_restart() and cfg.checkpoint.dir:
        # a restarted attempt continues from the last good checkpoint (replace() checks the config
        # again), a growing batch (--global-batch auto) at the batch it had grown to
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=True))
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL starts: its communicator binds the current GPU
    _init_process_group(datetime.timedelta(seconds=cfg.engine.collective_timeout_s), device)
    watch = (
        RefusalWatch(store_for_attempt(), dist.get_rank(), failures_dir)
        if failures_dir is not None
        else contextlib.nullcontext()
    )
    try:
        with watch:
            trainer = Trainer(
                cfg,
                stop_requested=stop_requested,
                callbacks=callbacks_from_env(),
                trusted_checkpoint=trusted_checkpoint,
            )
            return trainer.fit().to_dict()
    finally:
        dist.destroy_process_group()


def _init_process_group(timeout: datetime.timedelta, device: torch.device) -> None:
    """`device`'s backend over the store the agent (or torchrun) describes; `timeout` bounds every
    collective."""
    backend = backend_for(device)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        dist.init_process_group(backend, timeout=timeout, device_id=device_id_for(device))
        return
    # The agent's store outlives a restart and still holds the previous attempt's gloo addresses
    # under the same keys: a restarted worker that reads one before its peer overwrote it connects
    # to a dead port ("Gloo connectFullMesh failed ... Connection refused"). A prefix per attempt,
    # the same on every host (comm/attempt.py), keeps attempts apart.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    master = os.environ["MASTER_ADDR"]
    # a host whose name resolves to 127.0.0.1 makes gloo advertise loopback to the other hosts,
    # whose connects then fail ("connectFullMesh ... remote=[127.0.0.1]"): name the interface
    # that routes to the store instead, and say so
    if backend == "gloo" and (ifname := gloo_interface_hint(master)):
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
        if rank == 0:
            logger.info(
                "this host's name resolves to loopback; gloo uses %s, the interface toward %s "
                "(set GLOO_SOCKET_IFNAME to choose another)",
                ifname,
                master,
            )
    agent_store = dist.TCPStore(
        master, int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    store = dist.PrefixStore(f"dpscale/{attempt_id()}", agent_store)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timeout, device_id=device_id_for(device)
    )
    # where this rank runs, for errors that name a silent rank (read through the same store)
    publish_host(torch_private.default_store(), rank, master)


@dataclass(frozen=True, kw_only=True)
class WorkerOptions:
    """The worker's own flag under plain torchrun, besides TrainConfig's (torchrun owns the rest)."""

    threads: int = 1
    """intra-op threads per worker"""

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")
        if refusal := over_host_cap("--threads", self.threads):
            raise ConfigError(refusal)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dpscale.launch.worker", description=__doc__.splitlines()[0]
    )
    add_dataclass_arguments(parser, TrainConfig)
    add_dataclass_arguments(parser, WorkerOptions)
    parser.add_argument("--json", action="store_true", help="rank 0 prints the result as a JSON line")
    return parser


def main(argv: list[str] | None = None) -> int:
    if os.environ.get(LAUNCH_SPEC_ENV):
        return _launched()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        fields = dataclass_kwargs(args, TrainConfig)
        if fields.get("task") is None and fields.get("workload") is None:
            fields["workload"] = "digits"
        cfg = TrainConfig.from_flat(**fields)
        options = WorkerOptions(**dataclass_kwargs(args, WorkerOptions))
    except ConfigError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    warning = rendezvous_warning(os.environ.get("MASTER_ADDR"))
    if warning and int(os.environ.get("RANK", "0")) == 0:
        print(warning, file=sys.stderr, flush=True)
    die_with_parent(os.getppid())  # torchrun's agent
    result = run_worker(cfg.to_dict(), options.threads)
    if int(os.environ.get("RANK", "0")) == 0:
        if result.get("stop_message"):
            print(f"dpscale: {result['stop_message']}", file=sys.stderr, flush=True)
        if args.json:
            print(json.dumps(result), flush=True)
    return EXIT_DIVERGED if result.get("stopped_by") == "diverged" else 0


def forked() -> int:
    """Forked by `dpscale train` from its preloaded server (fork_start.py), the server being our
    parent: as `_launched`, dying with the server, which dies with the launcher."""
    # `top` and `ps -o comm` show the rank: the command line is the server's
    set_process_name(f"dpscale-rank{os.environ.get('RANK', '')}")
    launcher = int(os.environ[LAUNCHER_PID_ENV])
    server = os.getppid()
    if parent_of(server) not in (launcher, None):  # the launcher is gone already: so is this worker
        return 1
    return _launched(server)


def _launched(parent: int | None = None) -> int:
    """Started by `dpscale train`: the config comes from the launcher, rank 0's result goes back to it."""
    die_with_parent(int(os.environ[LAUNCHER_PID_ENV]) if parent is None else parent)
    spec = LaunchSpec.read(os.environ[LAUNCH_SPEC_ENV])
    stop_file = Path(spec.stop)
    try:
        # one stat per step; the file holds the signal's name
        result = run_worker(
            spec.config, spec.threads, lambda: _read(stop_file), spec.trusted_checkpoint, spec.failures
        )
    except ConfigError as e:
        # bad input is the same on every attempt: exit 0 so that the agent does not restart it
        # (protocol.py); the launcher reads the record, prints the line and exits 2
        _write_refusal(e, spec.failures)
        return 0
    except SystemExit as e:  # the user's code called sys.exit: never a success, never restarted
        _write_refusal(UserCodeError.from_exception(USER_EXIT, e), spec.failures)
        return 0
    except Exception as e:
        _write_failure(e, spec.failures)
        raise
    # the result is the same on every rank; each host's launcher reads its first worker's
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        write_atomically(spec.result, result)  # the launcher never reads half a result
    return 0  # a diverged run is reported by the launcher from the result, not by a restart


def _write_failure(error: BaseException, directory: str) -> None:
    """When a collective timed out, name the ranks that did not answer, for the launcher's summary."""
    while error is not None and not isinstance(error, CollectiveError):
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    if isinstance(error, CollectiveError) and error.silent_ranks:
        rank = int(os.environ.get("RANK", "0"))
        WorkerFailure(rank=rank, pid=os.getpid(), silent_ranks=error.silent_ranks).write(directory)


def _write_refusal(error: ConfigError, directory: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    message = str(error).splitlines()[0] if str(error) else type(error).__name__
    trace = error.user_traceback if isinstance(error, UserCodeError) else ""
    WorkerFailure(rank=rank, pid=os.getpid(), silent_ranks=[], bad_input=message, user_traceback=trace).write(
        directory
    )


def _read(path: Path) -> str | None:
    try:
        return path.read_text() or "signal"
    except FileNotFoundError:
        return None


if __name__ == "__main__":
    # @record writes an exception's traceback where the agent reads it for the failure summary
    exit_now(record(main)())
