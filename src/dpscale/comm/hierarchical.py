"""`hierarchical`: shared memory within each host, torch.distributed between hosts.

All-reduce in three phases, the shape of NCCL's and Horovod's hierarchical all-reduce: the
workers of a host sum their buffers in shared memory, each worker ending up with the host's sum
of one part (its local rank's); each worker all-reduces that part with the workers of the same
local rank on the other hosts, so every core and every connection takes part at once; then each
writes its part into every local peer's buffer. The result equals a flat all-reduce up to the
order of floating-point additions.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from dpscale.comm.base import global_rank
from dpscale.comm.process_group import ProcessGroupTransport
from dpscale.comm.shm import SharedMemoryTransport


class HierarchicalTransport:
    name = "hierarchical"

    def __init__(
        self, process_group: dist.ProcessGroup | None, host_ids: list[str], *, timeout_s: float = 300.0
    ):
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        hosts = list(dict.fromkeys(host_ids))  # in order of first appearance: the same on every rank
        per_host = [[r for r, h in enumerate(host_ids) if h == host] for host in hosts]
        sizes = {len(p) for p in per_host}
        if len(sizes) != 1:
            raise ValueError(
                f"hierarchical transport needs the same number of workers on every host, got "
                f"{[len(p) for p in per_host]}; start the same number per host or use transport='gloo'"
            )
        local_size = sizes.pop()
        # every rank must create every subgroup, in the same order; with the collective timeout,
        # which a subgroup does not inherit (torch's default is 30 min: a host cut off mid-step
        # would hang every rank that long)
        timeout = datetime.timedelta(seconds=timeout_s)
        local_groups = [
            dist.new_group([global_rank(process_group, r) for r in p], timeout=timeout) for p in per_host
        ]
        cross_groups = [
            dist.new_group([global_rank(process_group, p[i]) for p in per_host], timeout=timeout)
            for i in range(local_size)
        ]
        self._subgroups = [*local_groups, *cross_groups]
        my_host = hosts.index(host_ids[self.rank])
        self.local_rank = per_host[my_host].index(self.rank)
        self.num_hosts = len(hosts)
        self.local = SharedMemoryTransport(local_groups[my_host], timeout_s=timeout_s)
        self._cross = cross_groups[self.local_rank]
        self._flat = ProcessGroupTransport(process_group)

    def alloc(self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        return self.local.alloc(numel, dtype, device)

    def release(self, tensor: torch.Tensor) -> None:
        self.local.release(tensor)

    def all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        return self.local.all_reduce(tensor, between_hosts=self._between_hosts)

    def _between_hosts(self, part: torch.Tensor) -> None:
        if self.num_hosts > 1:
            dist.all_reduce(part, group=self._cross)

    # the rarer collectives go through the flat group: correct, and off the hot path
    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self._flat.broadcast(tensor, src)

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        self._flat.all_gather(output, tensor)

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        self._flat.reduce_scatter(output, tensor)

    def barrier(self) -> None:
        self._flat.barrier()

    def close(self) -> None:
        self.local.close()

    def describe(self) -> str:
        return (
            f"hierarchical ({self.num_hosts} hosts x {self.local.world_size} workers: shm within a host, "
            f"gloo between hosts)"
        )
