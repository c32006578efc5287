"""Evaluation over a task's `eval_data`, split across ranks and gathered: the loss and each metric
averaged over every sample exactly once, the same numbers on every rank.

Each rank takes a contiguous share of the eval set, sums the per-sample values in float64 and
counts its samples; one all-reduce of those sums gives the global means, whatever the world size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dpscale.comm.group_device import on_collective_device
from dpscale.engine.collective_log import CollectiveLog
from dpscale.workloads.task import Task, call_model, num_samples, per_sample, to_device


def shard(n: int, world_size: int, rank: int) -> range:
    """Rank `rank`'s contiguous share of n items; the first n % world_size ranks get one more."""
    size, extra = divmod(n, world_size)
    start = rank * size + min(rank, extra)
    return range(start, start + size + (rank < extra))


@torch.no_grad()
def evaluate(
    task: Task,
    module: nn.Module,
    *,
    batch_size: int,
    device: torch.device,
    autocast,
    group: dist.ProcessGroup | None = None,
    log: CollectiveLog | None = None,
) -> dict[str, float] | None:
    """{"loss": mean, <metric>: mean, ...} over `task.eval_data`, or None when it has none.

    Collective: every rank of `group` must call it. `autocast` is a callable giving the context
    the forward runs in (the training precision).
    """
    data = task.eval_data
    if data is None:
        return None
    names = ["loss", *task.metrics]
    fns = [task.per_sample_loss, *task.metrics.values()]
    # per name a sum, then the sample count: float64 so large eval sets sum exactly enough
    sums = torch.zeros(len(names) + 1, dtype=torch.float64, device=device)
    mine = shard(num_samples(data), dist.get_world_size(group), dist.get_rank(group))
    was_training = module.training
    module.eval()
    try:
        for lo in range(mine.start, mine.stop, batch_size):
            items = [data[i] for i in range(lo, min(lo + batch_size, mine.stop))]
            x, y = to_device(task.collate(items), device, non_blocking=True)
            with autocast():
                out = call_model(module, x)
                for j, (name, fn) in enumerate(zip(names, fns, strict=True)):
                    what = "Task.loss" if name == "loss" else f"Task.metrics[{name!r}]"
                    sums[j] += per_sample(what, fn(out, y), len(items)).double().sum()
            sums[-1] += len(items)
    finally:
        module.train(was_training)
    if log is not None:
        log.record("all_reduce", "evaluation sums", sums)
    sums = on_collective_device(sums, group)  # NCCL takes no CPU tensor, gloo beside it prefers them
    dist.all_reduce(sums, group=group)
    count = float(sums[-1])
    return {name: float(sums[j]) / count for j, name in enumerate(names)}
