"""The transport interface: the collectives the engine, benchmarks and optimizers use.

A transport sums (all_reduce, reduce_scatter) or moves (broadcast, all_gather) CPU or CUDA
tensors among the ranks of one job. `alloc` hands out buffers that the transport can reduce
without a staging copy (shared memory for `shm`); any tensor works, buffers from `alloc` are
faster. Every method is collective: all ranks call it in the same order with the same shapes.
`all_reduce` returns a torch Future so that asynchronous transports can overlap with compute.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist


class Transport(Protocol):
    name: str
    rank: int
    world_size: int

    def alloc(self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """A zeroed 1-D buffer that this transport reduces in place fastest (collective)."""
        ...

    def release(self, tensor: torch.Tensor) -> None:
        """Give back a buffer from `alloc` (every rank at the same point); others are ignored."""
        ...

    def all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Sum `tensor` over ranks in place; the Future completes then, its value `tensor` or `[tensor]`."""
        ...

    def broadcast(self, tensor: torch.Tensor, src: int) -> None: ...

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        """`output` (world_size * tensor.numel() elements) gets rank j's `tensor` at part j."""
        ...

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        """`output` gets this rank's part of the sum of `tensor` over ranks (parts as `chunk_bounds`)."""
        ...

    def barrier(self) -> None: ...

    def close(self) -> None: ...

    def describe(self) -> str:
        """One line for start-up messages and reports."""
        ...


def chunk_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """[lo, hi) of part `index` when n elements are split as evenly as possible into `parts`.

    The first n % parts parts get one extra element, so any length works, divisible or not.
    """
    size, extra = divmod(n, parts)
    lo = index * size + min(index, extra)
    return lo, lo + size + (1 if index < extra else 0)


def global_rank(group, rank: int) -> int:
    """The global rank of `group`'s rank `rank` (None: the default group, where they coincide)."""
    return dist.get_global_rank(group, rank) if group is not None else rank


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group) -> None:
    """`output` (world_size * tensor.numel() elements, contiguous) gets rank j's `tensor` at part j,
    gathered straight into it: a list of parts would make NCCL gather into a staging buffer and
    copy each part out."""
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output.view(-1), tensor.reshape(-1), group=group)


class _Completed(torch.futures.Future):
    """A Future completed with `value` when made. `wait` answers from Python: torch's goes into
    C++ and releases the GIL, ~0.4 us, which a synchronous transport's small all-reduce paid on
    every call; a completed Future with no devices (no CUDA streams to sync) returns the same."""

    def __init__(self, value: object):
        super().__init__()
        self.set_result(value)
        self._value = value

    def wait(self):
        return self._value


def completed(value: object) -> torch.futures.Future:
    return _Completed(value)


def group_rank(group) -> int:
    """This process's rank in `group` (None: the default group).

    Asks the group object itself, so a ProcessGroup built by hand (never registered with
    init_process_group, e.g. one implemented in Python) works too.
    """
    return dist.get_rank() if group is None else group.rank()


def group_size(group) -> int:
    return dist.get_world_size() if group is None else group.size()


def is_registered(group) -> bool:
    """Whether torch.distributed's module-level collectives know `group` (see `group_rank`)."""
    if group is None:
        return dist.is_initialized()
    try:
        dist.get_process_group_ranks(group)  # public; raises for a group torch never registered
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


# what torch's C++ passes to Work.wait: zero means "no timeout"
_NO_TIMEOUT = timedelta(0)


def wait_work(work) -> None:
    """Wait for a collective's `Work`, passing the timeout as torch's C++ does.

    A Work subclass written in Python (as a Python-implemented ProcessGroup returns, e.g. in
    pytorch's test_c10d_pypg.py) may declare `wait(self, timeout)` with no default: torch's own
    callers always pass one, so a bare `work.wait()` would raise TypeError there.
    """
    work.wait(_NO_TIMEOUT)
