"""`shm`: collectives for CPU workers on one host, through shared memory.

Each rank owns shared-memory segments that every peer maps. A buffer from `alloc` lives in one,
so the engine's gradient buckets are reduced where they are, with no send buffer. All-reduce is
a reduce-scatter then an all-gather in one sweep: rank r sums part r of the buffer over all
ranks and writes the sum into part r of *every* rank's buffer. Each part is touched by one rank
only, so two barriers suffice: one before (every rank's data is ready) and one after (every
rank has finished writing into my buffer). Tensors up to `shm_small.SMALL_MAX_BYTES` (float32 and
float64 up to `NATIVE_SMALL_MAX_BYTES` where the C helper runs them) take a
one-round path instead (every rank sums all ranks' copies, posted in mailboxes: one barrier),
with the same additions in the same order (`sum_order.py`), so the bits do not depend on the path;
for float32/float64 that path is one call into C where the helper builds (`shm_native.py`).

Barriers are per-rank counters in a shared control segment (`shm_wait.py`, which also holds how
a rank waits for a late peer). Small all-reduces are dominated by per-call overhead, not by
bytes: every region the transport has reduced keeps its peer views and its part's slices
(`_Region`), and parts up to `_NUMPY_MAX_BYTES` are summed with numpy, whose calls cost a fraction
of torch's (the sums are the same IEEE additions in the same order).

Segments are anonymous memory files (memfd), never names in /dev/shm: peers open the owner's
descriptor through /proc/<pid>/fd, which only the same user (or root) may do. So no other user
can pre-create a name to make set-up fail, nothing is visible while it runs, and no kill at any
moment can leave a segment behind: the memory goes when the last process mapping it ends.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dpscale.comm import shm_native, shm_small
from dpscale.comm.base import chunk_bounds, completed
from dpscale.comm.shm_small import Mailboxes, NativeCalls, SmallAllReduce
from dpscale.comm.shm_wait import WAIT_POLICIES, Counters, PeerTimeoutError
from dpscale.comm.sum_order import part_order, sum_into

__all__ = ["WAIT_POLICIES", "PeerTimeoutError", "SharedMemoryTransport"]

# Parts up to this size are summed and copied with numpy (~0.5 us a call here against torch's
# ~3 us); larger ones with torch, which is as fast per byte and may use several threads.
_NUMPY_MAX_BYTES = 1 << 16
_NUMPY_DTYPES = (torch.float32, torch.float64)  # half types accumulate in fp32 in torch
# Larger parts are summed and spread a chunk at a time when the rank runs torch on one thread (as
# one rank a core does): the copies into the peers' buffers then read the sum from cache rather than
# from memory again, 2 S bytes of traffic a rank instead of 2.5 S (benchmarks/peers/README.md, "The
# memory bound"). With more threads torch's one-pass add spreads over them and stays.
_CHUNK_BYTES = 1 << 18  # a chunk's sum and the peer slice it is written to fit in a 1 MiB L2 cache
# Regions remembered at most; a job reduces a fixed set (its buckets), so this only bounds a
# caller that reduces ever-new tensors through the staging buffer.
_MAX_REGIONS = 4096
# A rank's control segment: its barrier line (shm_wait.py) and the mailboxes for flagged words on a
# page of their own, then its two mailboxes for small all-reduces (shm_small.py)
_CTL_BYTES = 4096


# How a tensor is all-reduced in one round, looked up by the hot path in one step: (the C helper's
# call, its plan, the binding) where C runs it, (None, None, binding) where Python does, and
# (None, None, None) for a tensor that takes the in-place path (typed loosely: which items are None
# goes together, which mypy cannot follow without a check the hot path would pay for)
_Bound = tuple[Any, Any, Any]


def _bound(small: SmallAllReduce | None) -> _Bound:
    native = small.native if small is not None else None
    return (None, None, small) if native is None else (native.all_reduce, native.plan, small)


class _Segment:
    """One shared buffer per rank, all mapped here; `views[j]` is rank j's, as bytes."""

    def __init__(self, maps: list[mmap.mmap], nbytes: int, rank: int):
        self.maps = maps
        self.nbytes = nbytes
        self.views = [torch.frombuffer(m, dtype=torch.uint8, count=nbytes) for m in maps]
        self.base = self.views[rank].data_ptr()


class _Region:
    """One region of the segments (same offset in every rank's), with what collectives over it
    need, computed once: `views[j]` is rank j's copy; my all-reduce part is [lo, hi)."""

    def __init__(self, views: list[torch.Tensor], rank: int, world_size: int):
        self.views = views
        self.lo, self.hi = chunk_bounds(views[0].numel(), world_size, rank)
        # my part of every rank's buffer in the order they are added, mine first: the sum is
        # written over it, so it is read first
        self.parts = [views[j][self.lo : self.hi] for j in part_order(rank, world_size)]
        self.mine = self.parts[0]
        nbytes = self.mine.numel() * self.mine.element_size()
        small = self.mine.dtype in _NUMPY_DTYPES and nbytes <= _NUMPY_MAX_BYTES
        self.np_parts = [p.numpy() for p in self.parts] if small else None
        # the parts cut in chunks, chunk by chunk ([mine, other, ...] each), for the chunked path
        self.np_chunks: list[list[np.ndarray]] | None = None
        if not small and self.mine.dtype in _NUMPY_DTYPES and len(self.parts) > 1:
            step = _CHUNK_BYTES // self.mine.element_size()
            whole = [p.numpy() for p in self.parts]
            self.np_chunks = [[a[i : i + step] for a in whole] for i in range(0, len(whole[0]), step)]
        # the one-round all-reduce of the region, if it is small enough (set by the transport)
        self.small: SmallAllReduce | None = None
        # the last tensor reduced here and its completed Future, handed out again for the same tensor
        self.tensor: torch.Tensor | None = None
        self.future: torch.futures.Future | None = None

    def sum_and_spread(self, between_hosts=None) -> None:
        """Sum my part over all ranks and write the sum into every rank's copy of it;
        `between_hosts(part)`, if given, reduces the summed part across hosts before it spreads."""
        if self.np_parts is not None and between_hosts is None:
            mine, *others = self.np_parts
            for p in others:
                np.add(mine, p, out=mine)
            for p in others:
                np.copyto(p, mine)
            return
        if self.np_chunks is not None and between_hosts is None and torch.get_num_threads() == 1:
            # the same additions in the same order as sum_into, element by element
            for mine, *others in self.np_chunks:
                np.add(mine, others[0], out=mine)
                for p in others[1:]:
                    np.add(mine, p, out=mine)
                for p in others:
                    np.copyto(p, mine)
            return
        sum_into(self.mine, self.parts)
        if between_hosts is not None:
            between_hosts(self.mine)
        for part in self.parts[1:]:
            part.copy_(self.mine)

    def completed(self, tensor: torch.Tensor) -> torch.futures.Future:
        # A completed Future runs callbacks added later at once and keeps none, so one can serve
        # every call that passes the same tensor.
        if tensor is not self.tensor or self.future is None:
            self.tensor, self.future = tensor, completed(tensor)
        return self.future


class SharedMemoryTransport:
    """Collectives among the ranks of `process_group`, which must all run on this host.

    `process_group` (gloo) is used only to set up: exchange where the segments are and map them.
    `wait` is how a rank waits for a late peer (`shm_wait.WAIT_POLICIES`): `block` (default) sleeps
    in the kernel after a short spin, `spin` keeps the core busy for milliseconds first.
    """

    name = "shm"

    def __init__(
        self, process_group: dist.ProcessGroup | None = None, *, timeout_s: float = 300.0, wait: str = "block"
    ):
        if wait not in WAIT_POLICIES:
            choices = ", ".join(WAIT_POLICIES)
            raise ValueError(f"shm transport: wait={wait!r} is unknown; choose one of {choices}")
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.timeout_s = timeout_s
        self._segments: list[_Segment] = []
        self._regions: dict[tuple[int, int, torch.dtype], _Region] = {}
        self._staging: torch.Tensor | None = None
        python_max = shm_small.SMALL_MAX_BYTES  # read here, so a test can turn the path off (0)
        helper = shm_native.library() if python_max and self.world_size > 1 else None
        # every rank must send a tensor down the same path and lay out the same mailboxes: the C
        # helper's limit only where every rank has the helper (a rank may lack a compiler, or run
        # with DPSCALE_SHM_NATIVE=0)
        if not self._on_every_rank(helper is not None):
            helper = None
        oversubscribed = self._oversubscribed()
        native_max = shm_small.NATIVE_SMALL_MAX_BYTES
        if oversubscribed:
            native_max = shm_small.NATIVE_SMALL_MAX_BYTES_SHARED_CPUS
        capacity = python_max if helper is None else max(python_max, native_max)
        maps = self._map_all(_CTL_BYTES + 2 * capacity)
        self._ctl = Counters(maps, self.rank, timeout_s=timeout_s, wait=wait, oversubscribed=oversubscribed)
        native = None
        if helper is not None:
            native = NativeCalls(helper, wait == "block", shm_native.Wait(**self._ctl.native_wait()))
        ll_max = shm_small.LL_MAX_BYTES_SHARED_CPUS if oversubscribed else shm_small.LL_MAX_BYTES
        self._mail = Mailboxes(maps, _CTL_BYTES, capacity, self.rank, native, python_max, ll_max)
        # Where ranks share CPUs the in-place path's barriers first wait as the C helper does (it
        # yields to the peers), on a budget of their own: a peer that sums a large part for over a
        # millisecond then stops the barriers' yields, not the small all-reduces'. 4 ranks on 2
        # cores, against the Python wait alone, 5 runs: 128 KiB 0.29-0.88x, 256 KiB 0.28-0.96x
        # (its slow mode, one rank alone on a CPU sleeping, gone), 1 MiB 0.64-1.28x, 4 MiB
        # 0.95-0.98x (BENCHMARKS.md, "yielding to peers that share the CPU")
        self._barrier_wait = None
        if self._mail.native is not None and oversubscribed:
            self._barrier_wait = self._mail.waiter(shm_native.Wait(**self._ctl.native_wait()))
        # how each tensor in the segments is all-reduced in one round (`_bind_small`), and the last
        # tensor of the caller's with its own
        self._bound: dict[tuple[int, int, torch.dtype], _Bound] = {}
        self._last_private: tuple[tuple, _Bound] | None = None

    @property
    def wait(self) -> str:
        return self._ctl.wait

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

    def _on_every_rank(self, flag: bool) -> bool:
        """Collective: whether `flag` holds on every rank."""
        flags: list = [None] * self.world_size
        dist.all_gather_object(flags, flag, group=self.group)
        return all(flags)

    def _oversubscribed(self) -> bool:
        """Collective: whether the ranks have fewer CPUs among them than there are ranks (then a
        rank that spins while it waits holds a CPU that a late peer needs)."""
        cpus: list = [None] * self.world_size
        dist.all_gather_object(cpus, sorted(os.sched_getaffinity(0)), group=self.group)
        return len(set().union(*cpus)) < self.world_size

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
        self._regions.clear()  # some held views of that segment; the others are rebuilt on use
        self._bound.clear()

    # -- barriers ----------------------------------------------------------------------------
    def _arrive(self) -> int:
        return self._ctl.arrive()

    def _wait_all(self, seq: int, what: str) -> None:
        waiter = self._barrier_wait
        if waiter is None or waiter.wait_all(waiter.plan, seq):
            self._ctl.wait_all(seq, what)

    def barrier(self) -> None:
        self._wait_all(self._arrive(), "barrier")

    # -- locating a tensor in the segments ---------------------------------------------------
    def _region(self, tensor: torch.Tensor) -> _Region | None:
        """The region of the segments that `tensor` is, or None if it is not in them."""
        if not tensor.is_contiguous():
            return None
        key = (tensor.data_ptr(), tensor.numel(), tensor.dtype)
        region = self._regions.get(key)
        if region is None:
            views = self._peer_views(tensor)
            if views is None:
                return None
            if len(self._regions) >= _MAX_REGIONS:
                self._regions.clear()
            region = self._regions[key] = _Region(views, self.rank, self.world_size)
            if self._mail.fits(tensor):
                region.small = self._mail.bind(views[self.rank])
        return region

    def _peer_views(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """The same region of every rank's segment, indexed by rank; None if `tensor` is not ours."""
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        for seg in self._segments:
            if seg.base <= ptr and ptr + nbytes <= seg.base + seg.nbytes:
                off = ptr - seg.base
                return [v[off : off + nbytes].view(tensor.dtype) for v in seg.views]
        return None

    def _staged(self, tensor: torch.Tensor) -> _Region:
        """The region of a staging copy, for tensors that do not live in our segments."""
        nbytes = tensor.numel() * tensor.element_size()
        if self._staging is None or self._staging.numel() < nbytes:
            # every rank sees the same sizes in the same order, so this collective matches up
            self._staging = self.alloc(max(nbytes, 1 << 16), torch.uint8)
        buf = self._staging[:nbytes].view(tensor.dtype)
        buf.copy_(tensor.reshape(-1))
        region = self._region(buf)
        assert region is not None  # the staging buffer lives in our segments
        return region

    def _region_for(self, tensor: torch.Tensor) -> tuple[_Region, bool]:
        """(region, staged): `tensor`'s own region, or a staging copy's that must be copied back."""
        region = self._region(tensor)
        if region is not None:
            return region, False
        return self._staged(tensor), True

    # -- collectives -------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, between_hosts=None) -> torch.futures.Future:
        """Sum in place. `between_hosts(part)`, if given, reduces my summed part across hosts."""
        if between_hosts is None and tensor.is_contiguous():
            # The hot path: a small tensor reduced before is one look-up by what its binding was
            # made for (every pointer in it derives from the key's address) and one call into C.
            # At a few bytes the call's Python costs more than its bytes, so _region and
            # SmallAllReduce.run are inlined here (BENCHMARKS.md, "Small messages in one round").
            key = (tensor.data_ptr(), tensor.numel(), tensor.dtype)
            bound = self._bound.get(key)
            if bound is None:
                last = self._last_private
                bound = last[1] if last is not None and last[0] == key else self._bind_small(tensor, key)
            call, plan, small = bound
            if call is not None:
                if call(plan):  # a peer did not arrive within the C wait (spin or yields)
                    small.finish(self._ctl)
                return small.future if tensor is small.tensor else small.completed(tensor)
            if small is not None:
                small.run(self._ctl)
                return small.future if tensor is small.tensor else small.completed(tensor)
        return self._all_reduce_two_barriers(tensor, between_hosts)

    def _bind_small(self, tensor: torch.Tensor, key: tuple) -> _Bound:
        """How contiguous `tensor` (`key`) is all-reduced in one round, found on its first call."""
        region = self._region(tensor)
        if region is not None:
            bound = _bound(region.small)
            if len(self._bound) >= _MAX_REGIONS:
                self._bound.clear()
            self._bound[key] = bound
            return bound
        if self._last_private is None or self._last_private[0] != key:
            # A tensor of the caller's: only the last one's binding is kept (it holds the tensor, as
            # the staging region holds the last staged one), for callers that reduce one tensor often.
            small = self._mail.bind(tensor) if self._mail.fits(tensor) else None
            self._last_private = (key, _bound(small))
        return self._last_private[1]

    def _all_reduce_two_barriers(self, tensor: torch.Tensor, between_hosts) -> torch.futures.Future:
        """The all-reduce of a tensor the one-round path does not take (too large, not contiguous,
        or reduced across hosts too): in place, or in a staging copy."""
        region = self._region(tensor)
        if region is None:  # a tensor of the caller's: reduced in a staging copy
            staging = self._staged(tensor)
            self._all_reduce_in_place(staging, between_hosts)
            tensor.copy_(staging.views[self.rank].view(tensor.shape))  # staged in logical order
            return completed(tensor)
        self._all_reduce_in_place(region, between_hosts)
        return region.completed(tensor)

    def _all_reduce_in_place(self, region: _Region, between_hosts) -> None:
        self._wait_all(self._arrive(), "all_reduce: inputs ready")
        # an empty part still takes part in the cross-host collective, which every rank issues
        if region.hi > region.lo or between_hosts is not None:
            region.sum_and_spread(between_hosts)
        self._wait_all(self._arrive(), "all_reduce: results written")

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        region, staged = self._region_for(tensor)
        views = region.views
        self._wait_all(self._arrive(), "broadcast: source ready")
        if self.rank != src:
            views[self.rank].copy_(views[src])
        self._wait_all(self._arrive(), "broadcast: copied")
        if staged:  # staged in logical order, so back through the tensor's own shape and strides
            tensor.copy_(views[self.rank].view(tensor.shape))

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        region, _ = self._region_for(tensor)
        self._wait_all(self._arrive(), "all_gather: inputs ready")
        n = tensor.numel()
        out = output.view(-1)
        for j, v in enumerate(region.views):
            out[j * n : (j + 1) * n].copy_(v)
        self._wait_all(self._arrive(), "all_gather: copied")

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        region, _ = self._region_for(tensor)
        self._wait_all(self._arrive(), "reduce_scatter: inputs ready")
        lo, hi = region.lo, region.hi
        sum_into(output.view(-1), [v[lo:hi] for v in region.views])
        self._wait_all(self._arrive(), "reduce_scatter: read")

    def close(self) -> None:
        self._segments.clear()
        self._regions.clear()
        self._bound.clear()
        self._staging = None
        self._last_private = None

    def describe(self) -> str:
        small = "C" if self._mail.native is not None else "Python"
        return f"shm ({self.world_size} workers, shared memory on one host; small all-reduces in {small})"


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
