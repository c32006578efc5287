"""Start the training workers: in this process for one worker, through torch's elastic agent for more.

The agent (torch.distributed.launcher, what torchrun runs) does the rendezvous on 127.0.0.1 with
a port the OS picks, restarts every worker when one fails (up to `max_restarts`), and hands each
worker its rank through the environment. A restarted worker resumes from the last good checkpoint.
`worker_main` is the same entry point a plain `torchrun -m dpscale.train.worker` uses.
"""

from __future__ import annotations

import datetime
import os
import uuid

import torch
import torch.distributed as dist

from .config import TrainConfig
from .trainer import Trainer, TrainResult

# Collectives that have not completed after this long raise instead of hanging for torch's
# default 30 minutes; a healthy step here takes milliseconds.
DEFAULT_COLLECTIVE_TIMEOUT_S = 300


def default_threads(nproc: int) -> int:
    return max(1, (os.cpu_count() or 1) // nproc)


def run_worker(config: dict, threads: int) -> dict:
    """One worker: join the group the agent (or torchrun) describes in the environment, train."""
    torch.set_num_threads(threads)
    cfg = TrainConfig.from_dict(config)
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and cfg.checkpoint_dir:
        cfg.resume = True  # a restarted attempt continues from the last good checkpoint
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=DEFAULT_COLLECTIVE_TIMEOUT_S))
    try:
        return Trainer(cfg).fit().to_dict()
    finally:
        dist.destroy_process_group()


def launch(cfg: TrainConfig, nproc: int, *, max_restarts: int = 0, threads: int | None = None) -> TrainResult:
    """Train with `nproc` workers on this host; returns rank 0's result."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    cfg.resolve_batch(nproc)  # fail before starting anything when the batch does not split
    threads = threads or default_threads(nproc)
    if nproc == 1 and max_restarts == 0:
        return _run_in_process(cfg, threads)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launch_cfg = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"dpscale-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # loopback only; port 0: the OS picks a free one
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
    )
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    results = elastic_launch(launch_cfg, run_worker)(cfg.to_dict(), threads)
    return TrainResult(**results[0])


def _run_in_process(cfg: TrainConfig, threads: int) -> TrainResult:
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return Trainer(cfg).fit()
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(old)
