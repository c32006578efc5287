"""Uneven data across ranks: a join policy for loaders of different lengths.

`Trainer` never needs this: its `GlobalBatchSampler` gives every rank the same number of steps.
A user's own loop with its own per-rank loader may not (a sharded dataset whose shards differ in
size, a filter that drops samples). Then the rank that runs out first stops issuing collectives
and every other rank hangs in its next gradient reduction until the timeout.

The policy here is "stop at the shortest": before each step, one small all-reduce of a "have a
batch" flag (MIN over ranks) tells every rank whether all of them have one. If any rank is out,
every rank stops before the step, so all ranks run the same number of steps and no collective is
left unmatched. The batches the longer ranks had left are not used, the same as torch's
DistributedSampler(drop_last=True) and the trainer's tail="drop". The cost is one all-reduce of a
single int per step, small next to a gradient reduction.

    for x, y in iterate_in_lockstep(loader, process_group):
        loss = loss_fn(model(x), y)
        ...
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from dpscale.comm.group_device import collective_device
from dpscale.engine.collective_log import CollectiveLog

T = TypeVar("T")


@dataclass
class LockstepStats:
    """After the loop: how many steps ran, and whether this rank had batches left over."""

    steps: int = 0
    stopped_early: bool = False  # this rank still had a batch when another ran out


def iterate_in_lockstep(
    loader: Iterable[T],
    process_group: dist.ProcessGroup | None = None,
    *,
    stats: LockstepStats | None = None,
    log: CollectiveLog | None = None,
    device: torch.device | str | None = None,
) -> Iterator[T]:
    """Yield `loader`'s items while every rank of `process_group` still has one (collective).

    Every rank must call this with its own loader and consume the generator to its end (or until
    all stop together); `stats`, if given, is filled in as the loop runs. `device` is where the
    flag lives: by default where the group's collectives need it (a GPU for NCCL).
    """
    stats = stats if stats is not None else LockstepStats()
    it = iter(loader)
    where = collective_device(process_group) if device is None else device
    while True:
        try:
            item, have = next(it), True
        except StopIteration:
            have = False
        flag = torch.tensor([1 if have else 0], dtype=torch.int32, device=where)
        if log is not None:
            log.record("all_reduce", "have-a-batch flag", flag)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=process_group)
        if not int(flag.item()):
            stats.stopped_early = have
            return
        stats.steps += 1
        yield item
