"""Start the training workers: in this process for one worker, through torch's elastic agent for more.

The agent (torch.distributed.launcher, what torchrun runs) does the rendezvous on 127.0.0.1 with
a port the OS picks, restarts every worker when one fails (up to `max_restarts`), and hands each
worker its rank through the environment. A restarted worker resumes from the last good checkpoint.
`run_worker` is the same entry point a plain `torchrun -m dpscale.train.worker` uses.

On one host the agent always restarts the same number of workers, so a world size range
`min_nproc..nproc` means: start `nproc`; when every restart at that size has failed, launch again
with the next smaller size whose workers split the global batch, resuming from the last checkpoint
(see docs/fault-tolerance.md for what this can and cannot do).
"""

from __future__ import annotations

import datetime
import ipaddress
import multiprocessing as mp
import os
import socket
import sys
import uuid
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from ..cores import usable_cores
from .config import TrainConfig
from .device import backend_for, resolve_device
from .trainer import Trainer, TrainResult

# Imported once by the forkserver the agent starts workers from, so a worker (and every restart)
# forks with them loaded instead of spending seconds importing them again.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "dpscale.train.launch"]


class LaunchError(RuntimeError):
    """Every attempt failed; the message names the failing rank and holds its traceback."""


def default_threads(nproc: int) -> int:
    """Intra-op threads per worker: the cores this process may use, split evenly."""
    return max(1, usable_cores() // nproc)


def rendezvous_warning(addr: str | None) -> str | None:
    """A warning if workers meet at a non-loopback address, else None."""
    if not addr:
        return None
    try:
        # every address the name resolves to: "localhost" may also resolve to a public one
        addresses = {info[4][0] for info in socket.getaddrinfo(addr, None)}
        loopback = all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)
    except (OSError, ValueError):
        loopback = False
    if loopback:
        return None
    return (
        f"dpscale: warning: workers rendezvous at {addr}, which is not a loopback address. torch's "
        "rendezvous store has no authentication: anyone who can reach it can join or disrupt the job. "
        "Run multi-host jobs on a trusted network only (docs/fault-tolerance.md)."
    )


def parse_nproc(text: str) -> tuple[int, int]:
    """`N` or `MIN:MAX` -> (min_nproc, nproc); ValueError saying what is accepted."""
    parts = str(text).split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, 0)
    except ValueError:
        low = high = 0
    if not 1 <= low <= high:
        raise ValueError(f"--nproc must be N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return low, high


def run_worker(config: dict, threads: int) -> dict:
    """One worker: join the group the agent (or torchrun) describes in the environment, train."""
    torch.set_num_threads(threads)
    cfg = TrainConfig.from_dict(config)
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and cfg.checkpoint_dir:
        cfg.resume = True  # a restarted attempt continues from the last good checkpoint
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL starts: its communicator binds the current GPU
    _init_process_group(datetime.timedelta(seconds=cfg.collective_timeout_s), backend_for(device))
    try:
        return Trainer(cfg).fit().to_dict()
    finally:
        dist.destroy_process_group()


def _init_process_group(timeout: datetime.timedelta, backend: str = "gloo") -> None:
    """`backend` over the store the agent (or torchrun) describes; `timeout` bounds every collective."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        dist.init_process_group(backend, timeout=timeout)
        return
    # The agent's store outlives a restart and still holds the previous attempt's gloo addresses
    # under the same keys: a restarted worker that reads one before its peer overwrote it connects
    # to a dead port ("Gloo connectFullMesh failed ... Connection refused"). A prefix per attempt
    # keeps attempts apart.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"dpscale/attempt_{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def launch(
    cfg: TrainConfig,
    nproc: int,
    *,
    min_nproc: int | None = None,
    max_restarts: int = 0,
    threads: int | None = None,
) -> TrainResult:
    """Train with `nproc` workers on this host (down to `min_nproc` if they keep failing).

    Returns rank 0's result; raises LaunchError when every attempt at every size failed.
    """
    min_nproc = nproc if min_nproc is None else min_nproc
    if not 1 <= min_nproc <= nproc:
        raise ValueError(f"nproc must be N or MIN:MAX with 1 <= MIN <= MAX, got {min_nproc}:{nproc}")
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
    # fail before starting anything when the batch does not split (resolve_batch names the numbers);
    # a scale-lr resume with a checkpoint splits the checkpoint's per-worker batch instead
    if not _can_start(cfg, nproc):
        cfg.resolve_batch(nproc)
    if not _splits(cfg, min_nproc):
        cfg.resolve_batch(min_nproc)
    if nproc == 1 and max_restarts == 0:
        return _run_in_process(cfg, threads or default_threads(1))
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    n = nproc
    while True:
        try:
            return _launch_elastic(cfg, n, max_restarts, threads or default_threads(n))
        except ChildFailedError as e:
            failure = _describe_failure(e, n, max_restarts)
            # a fresh agent counts restarts from 0, so resuming must be asked for explicitly
            cfg = replace(cfg, resume=bool(cfg.checkpoint_dir))
            smaller = (m for m in range(n - 1, min_nproc - 1, -1) if _can_start(cfg, m))
            n = next(smaller, None)
            if n is None:
                raise LaunchError(failure) from None
            print(
                f"dpscale: {failure.splitlines()[0]}; launching again with {n} workers",
                file=sys.stderr,
                flush=True,
            )


def _splits(cfg: TrainConfig, n: int) -> bool:
    """Whether n workers may be asked for: the configured batch splits, or scale-lr may take a
    checkpoint's per-worker batch (whether one exists is known only when it comes to it)."""
    if cfg.world_change == "scale-lr" and cfg.checkpoint_dir:
        return True
    return _configured_split(cfg, n)


def _can_start(cfg: TrainConfig, n: int) -> bool:
    """Whether n workers can start now: the configured batch splits, or a scale-lr resume has a checkpoint."""
    if cfg.world_change == "scale-lr" and cfg.resume and cfg.checkpoint_dir:
        if any(Path(cfg.checkpoint_dir).glob("step-*")):
            return True
    return _configured_split(cfg, n)


def _configured_split(cfg: TrainConfig, n: int) -> bool:
    try:
        cfg.resolve_batch(n)
    except ValueError:
        return False
    return True


def _launch_elastic(cfg: TrainConfig, nproc: int, max_restarts: int, threads: int) -> TrainResult:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    endpoint = "127.0.0.1:0"  # loopback only; port 0: the OS picks a free one
    if warning := rendezvous_warning(endpoint.rsplit(":", 1)[0]):
        print(warning, file=sys.stderr, flush=True)
    launch_cfg = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"dpscale-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="forkserver",
    )
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    mp.set_forkserver_preload(_PRELOAD)
    results = elastic_launch(launch_cfg, run_worker)(cfg.to_dict(), threads)
    return TrainResult(**results[0])


def _describe_failure(e: Exception, nproc: int, max_restarts: int) -> str:
    """First line: what failed; then the first failing worker's traceback, as the agent recorded it."""
    attempts = f"{max_restarts + 1} attempt{'s' if max_restarts else ''}"
    try:
        rank, failure = e.get_first_failure()
        head = f"training with {nproc} workers failed after {attempts} (--max-restarts {max_restarts}); "
        head += f"last failure: rank {rank}"
        if failure.exitcode < 0:
            head += f" was killed by signal {-failure.exitcode}"
        else:
            head += f" exited with code {failure.exitcode}"
        trace = failure.error_file_data.get("message", {}).get("extraInfo", {}).get("py_callstack", "")
    except Exception:  # the agent's error record is best effort; never hide the failure behind it
        return f"training with {nproc} workers failed after {attempts}: {e}"
    return head + (":\n" + trace.rstrip() if trace else "")


def _run_in_process(cfg: TrainConfig, threads: int) -> TrainResult:
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    device = resolve_device(cfg.device, local_rank=0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), store=dist.HashStore(), rank=0, world_size=1)
    try:
        return Trainer(cfg).fit()
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(old)
