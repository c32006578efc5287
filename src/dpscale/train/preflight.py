"""Checks of a training run that can be made before any worker starts, so bad input costs one line
and exit code 2 instead of a traceback from every worker.

The task is loaded and probed (its model built, a couple of items of each dataset run through the
model, loss and metrics), its training set compared with the global batch, and the device checked
for the largest world size the run may use.
"""

from __future__ import annotations

from ..workloads.task import probe
from .config import TrainConfig
from .device import resolve_device
from .trainer import resolve_task


def preflight(cfg: TrainConfig, world_sizes: list[int]) -> None:
    """ValueError (one line, naming what to change) for anything that would fail in the workers."""
    for n in sorted(set(world_sizes), reverse=True):
        cfg.resolve_batch(n)
        if cfg.device != "cpu":
            resolve_device(cfg.device, local_rank=n - 1)
    task = resolve_task(cfg)
    probe(task)
    if cfg.tail == "drop" and len(task.train_data) < cfg.global_batch:
        raise ValueError(
            f"train_data has {len(task.train_data)} samples, fewer than one global batch of "
            f"{cfg.global_batch}; use --global-batch {len(task.train_data)} or less, or --tail keep"
        )
