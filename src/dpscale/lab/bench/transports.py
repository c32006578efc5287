"""The transports the all-reduce bench times, one `TransportSpec` each: how a rank opens it, and
why it cannot run here (nccl without CUDA). `predict`'s sync calibration opens them the same way.

The engine's own transports live in `comm/` and are chosen by `comm/select.py`; an entry here
only adapts one to what a bench rank needs: an in-place all-reduce that returns when the sum is in
the tensor, a buffer of the transport's own memory, and a close.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankTransport:
    """One rank's end of a transport. `all_reduce` sums a tensor in place across ranks and returns
    only once the result is in the tensor (GPU transports synchronize), so wall time measures it."""

    all_reduce: Callable[[torch.Tensor], None]
    close: Callable[[], None]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # the transport's own buffers (shared memory for shm), as the engine's buckets are
    alloc: Callable[[int], torch.Tensor] | None = None

    def buffer(self, numel: int) -> torch.Tensor:
        if self.alloc is not None:
            return self.alloc(numel)
        return torch.zeros(numel, dtype=torch.float32, device=self.device)


def _always_available(world_size: int) -> str | None:
    return None


@dataclass(frozen=True)
class TransportSpec:
    """How to open a transport on a rank. `setup(rank, world_size)` runs inside every rank, where the
    default (gloo) process group already exists; it must be a module-level function, since the spec
    is pickled into the ranks. `unavailable(world_size)` says why it cannot run here, or None."""

    setup: Callable[[int, int], RankTransport]
    description: str
    unavailable: Callable[[int], str | None] = _always_available


TRANSPORTS: dict[str, TransportSpec] = {}


def register_transport(name: str, spec: TransportSpec) -> None:
    TRANSPORTS[name] = spec


def _gloo_setup(rank: int, world_size: int) -> RankTransport:
    # The default group belongs to the harness that created it; closing is its job, not ours.
    return RankTransport(all_reduce=lambda t: dist.all_reduce(t), close=lambda: None)


def _nccl_unavailable(world_size: int) -> str | None:
    if not torch.cuda.is_available():
        return "it needs CUDA and torch.cuda.is_available() is False here"
    if world_size > torch.cuda.device_count():
        return f"it needs one GPU per rank; world size {world_size} > {torch.cuda.device_count()} GPUs"
    return None


def _nccl_setup(rank: int, world_size: int) -> RankTransport:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    group = dist.new_group(backend="nccl")

    def all_reduce(t: torch.Tensor) -> None:
        dist.all_reduce(t, group=group)
        torch.cuda.synchronize(device)  # NCCL returns at enqueue; the clock must see completion

    return RankTransport(
        all_reduce=all_reduce, close=lambda: dist.destroy_process_group(group), device=device
    )


def _shm_setup(rank: int, world_size: int) -> RankTransport:
    from dpscale.comm import SharedMemoryTransport

    shm = SharedMemoryTransport()
    return RankTransport(
        all_reduce=lambda t: shm.all_reduce(t).wait(),
        close=shm.close,
        alloc=lambda numel: shm.alloc(numel, torch.float32),
    )


register_transport("gloo", TransportSpec(_gloo_setup, "torch.distributed gloo (CPU tensors)"))
register_transport("shm", TransportSpec(_shm_setup, "dpscale shared memory (CPU workers on one host)"))
register_transport(
    "nccl", TransportSpec(_nccl_setup, "torch.distributed NCCL (one GPU per rank)", _nccl_unavailable)
)


def available_transports(world_size: int = 2) -> list[str]:
    """Every registered transport that can run here (nccl only with CUDA, shm only on x86-64)."""
    from dpscale.comm.select import shm_is_safe

    names = [n for n, spec in TRANSPORTS.items() if spec.unavailable(world_size) is None]
    return [n for n in names if n != "shm" or shm_is_safe()]
