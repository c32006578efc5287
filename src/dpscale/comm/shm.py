"""`shm`: collectives for CPU workers on one host, through shared memory.

Each rank owns shared-memory segments that every peer maps. A buffer from `alloc` lives in one,
so the engine's gradient buckets are reduced where they are, with no send buffer. All-reduce is
a reduce-scatter then an all-gather in one sweep: rank r sums part r of the buffer over all
ranks and writes the sum into part r of *every* rank's buffer. Each part is touched by one rank
only, so two barriers suffice: one before (every rank's data is ready) and one after (every
rank has finished writing into my buffer).

Barriers are per-rank counters in a shared control segment, each written by its owner alone, so
plain stores and loads suffice: x86-64 keeps stores in order (a peer that sees the counter also
sees the data written before it). Waiting spins briefly, then yields, then sleeps, so a slow
peer does not starve the core; past `timeout_s` it raises and names the rank it waited for.

Segments are anonymous memory files (memfd), never names in /dev/shm: peers open the owner's
descriptor through /proc/<pid>/fd, which only the same user (or root) may do. So no other user
can pre-create a name to make set-up fail, nothing is visible while it runs, and no kill at any
moment can leave a segment behind: the memory goes when the last process mapping it ends.
"""

from __future__ import annotations

import mmap
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from .base import chunk_bounds, completed

_LINE = 8  # int64 slots per counter: one 64-byte cache line each, no false sharing
_SPIN = 2000  # busy checks before yielding: covers a peer that is microseconds behind
_YIELD = 20000  # yields before sleeping


class PeerTimeoutError(RuntimeError):
    """A peer did not reach a collective in time."""


class _Segment:
    """One shared buffer per rank, all mapped here; `views[j]` is rank j's, as bytes."""

    def __init__(self, maps: list[mmap.mmap], nbytes: int, rank: int):
        self.maps = maps
        self.nbytes = nbytes
        self.views = [torch.frombuffer(m, dtype=torch.uint8, count=nbytes) for m in maps]
        self.base = self.views[rank].data_ptr()


class SharedMemoryTransport:
    """Collectives among the ranks of `process_group`, which must all run on this host.

    `process_group` (gloo) is used only to set up: exchange where the segments are and map them.
    """

    name = "shm"

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, timeout_s: float = 300.0):
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.timeout_s = timeout_s
        self._seq = 0
        self._segments: list[_Segment] = []
        self._staging: torch.Tensor | None = None
        # one cache line of counters per rank, written by its owner only
        self._ctl_maps = self._map_all(64)
        self._ctl = [np.frombuffer(m, dtype=np.int64, count=_LINE) for m in self._ctl_maps]

    # -- set-up ------------------------------------------------------------------------------
    def _map_all(self, nbytes: int) -> list[mmap.mmap]:
        """Collective: every rank creates a segment of `nbytes` and maps everyone's."""
        size = max(nbytes, 1)
        fd = os.memfd_create("dpscale-shm", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            owners: list = [None] * self.world_size
            dist.all_gather_object(owners, (os.getpid(), fd), group=self.group)
            maps = []
            for j, (pid, owner_fd) in enumerate(owners):
                maps.append(mmap.mmap(fd, size) if j == self.rank else _map_peer(pid, owner_fd, size, j))
            # every peer has opened mine: my descriptor may go (the mappings keep the memory)
            dist.barrier(group=self.group)
        finally:
            os.close(fd)
        return maps

    def alloc(self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """A zeroed buffer in fresh segments, mapped by every peer (collective)."""
        if torch.device(device).type != "cpu":
            raise ValueError("the shm transport reduces CPU tensors; use nccl for CUDA tensors")
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        seg = _Segment(self._map_all(nbytes), nbytes, self.rank)
        self._segments.append(seg)
        return seg.views[self.rank].view(dtype)[:numel]

    def release(self, tensor: torch.Tensor) -> None:
        """Forget the segment holding `tensor` (local: peers release theirs at the same point)."""
        ptr = tensor.data_ptr()
        self._segments = [s for s in self._segments if not s.base <= ptr < s.base + max(s.nbytes, 1)]

    # -- barriers ----------------------------------------------------------------------------
    def _arrive(self) -> int:
        self._seq += 1
        self._ctl[self.rank][0] = self._seq
        return self._seq

    def _wait_all(self, seq: int, what: str) -> None:
        for j in range(self.world_size):
            ctl = self._ctl[j]
            if j == self.rank or ctl[0] >= seq:
                continue
            spins, deadline = 0, None
            while ctl[0] < seq:
                spins += 1
                if spins < _SPIN:
                    continue
                if spins < _YIELD:
                    os.sched_yield()
                    continue
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.timeout_s
                elif now > deadline:
                    raise PeerTimeoutError(
                        f"shm transport: rank {self.rank} waited {self.timeout_s:.0f} s for rank {j} at "
                        f"collective #{seq} ({what}); rank {j} last reached #{int(ctl[0])}: it died, "
                        "hangs, or issued different collectives"
                    )
                time.sleep(0.0005)

    def barrier(self) -> None:
        self._wait_all(self._arrive(), "barrier")

    # -- locating a tensor in the segments ---------------------------------------------------
    def _peer_views(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """The same region of every rank's segment, indexed by rank; None if `tensor` is not ours."""
        if not tensor.is_contiguous():
            return None
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        for seg in self._segments:
            if seg.base <= ptr and ptr + nbytes <= seg.base + seg.nbytes:
                off = ptr - seg.base
                return [v[off : off + nbytes].view(tensor.dtype) for v in seg.views]
        return None

    def _staged(self, tensor: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Peer views of a staging copy, for tensors that do not live in our segments."""
        n = tensor.numel()
        if (
            self._staging is None
            or self._staging.numel() * self._staging.element_size() < n * tensor.element_size()
        ):
            # every rank sees the same sizes in the same order, so this collective matches up
            self._staging = self.alloc(max(n * tensor.element_size(), 1 << 16), torch.uint8)
        buf = self._staging[: n * tensor.element_size()].view(tensor.dtype)
        buf.copy_(tensor.reshape(-1))
        return self._peer_views(buf), buf

    def _views_for(self, tensor: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        views = self._peer_views(tensor)
        if views is not None:
            return views, None
        return self._staged(tensor)

    # -- collectives -------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, between_hosts=None) -> torch.futures.Future:
        """Sum in place. `between_hosts(part)`, if given, reduces my summed part across hosts."""
        views, staged = self._views_for(tensor)
        self._wait_all(self._arrive(), "all_reduce: inputs ready")
        lo, hi = chunk_bounds(views[0].numel(), self.world_size, self.rank)
        if hi > lo:
            mine = views[self.rank][lo:hi]
            # my own part first: the sum is written over it, so it must be read before
            _sum_into(mine, [mine] + [v[lo:hi] for j, v in enumerate(views) if j != self.rank])
            if between_hosts is not None:
                between_hosts(mine)
            for j, v in enumerate(views):
                if j != self.rank:
                    v[lo:hi].copy_(mine)
        elif between_hosts is not None:
            between_hosts(views[self.rank][lo:hi])
        self._wait_all(self._arrive(), "all_reduce: results written")
        if staged is not None:
            tensor.view(-1).copy_(staged)
        return completed(tensor)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        views, staged = self._views_for(tensor)
        self._wait_all(self._arrive(), "broadcast: source ready")
        if self.rank != src:
            views[self.rank].copy_(views[src])
        self._wait_all(self._arrive(), "broadcast: copied")
        if staged is not None:
            tensor.view(-1).copy_(staged)

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        views, _ = self._views_for(tensor)
        self._wait_all(self._arrive(), "all_gather: inputs ready")
        n = tensor.numel()
        out = output.view(-1)
        for j, v in enumerate(views):
            out[j * n : (j + 1) * n].copy_(v)
        self._wait_all(self._arrive(), "all_gather: copied")

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        views, _ = self._views_for(tensor)
        self._wait_all(self._arrive(), "reduce_scatter: inputs ready")
        lo, hi = chunk_bounds(tensor.numel(), self.world_size, self.rank)
        _sum_into(output.view(-1), [v[lo:hi] for v in views])
        self._wait_all(self._arrive(), "reduce_scatter: read")

    def close(self) -> None:
        self._segments.clear()
        self._staging = None

    def describe(self) -> str:
        return f"shm ({self.world_size} workers, shared memory on one host)"


def _map_peer(pid: int, fd: int, size: int, rank: int) -> mmap.mmap:
    try:
        peer_fd = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    except OSError as e:
        raise RuntimeError(
            f"shm transport: cannot open rank {rank}'s segment through /proc/{pid}/fd/{fd} ({e.strerror}); "
            "every worker on a host must run as the same user in the same PID namespace, else use "
            "transport 'gloo'"
        ) from e
    try:
        return mmap.mmap(peer_fd, size)
    finally:
        os.close(peer_fd)


def _sum_into(out: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """out = sum(parts), in one pass where possible; fp16/bf16 accumulate in fp32.

    `out` may be `parts[0]` (never a later part: it is overwritten by the first add).
    """
    if len(parts) == 1:
        if out.data_ptr() != parts[0].data_ptr():
            out.copy_(parts[0])
        return
    if len(parts) == 2 or out.dtype in (torch.float32, torch.float64):
        # torch's CPU add computes half types in fp32 and rounds once per add
        torch.add(parts[0], parts[1], out=out)
        for p in parts[2:]:
            out.add_(p)
        return
    acc = parts[0].float()
    for p in parts[1:]:
        acc.add_(p)
    out.copy_(acc)
