"""The shm transport's one-round all-reduce for small tensors, through mailboxes.

For a small tensor the in-place all-reduce's two barriers (shm.py) cost more than its bytes. Here
every rank copies its tensor into a mailbox of its own in shared memory, arrives once, and when
every peer has arrived sums all ranks' mailboxes into its own tensor. No rank writes memory that a
peer may still read, so one synchronization a call suffices: each rank has two mailboxes and
fills them in turn, by the parity of the collective's sequence number. A rank fills a mailbox
again two collectives later at the earliest, after it has seen every peer arrive at the
collective in between, and a peer arrives there only once it has read the mailbox. (DeepSpeed's
CPU shared-memory all-reduce synchronizes small messages once a call in the same way, with flag
states: csrc/cpu/comm/shm.cpp in microsoft/DeepSpeed.)

Each rank adds every part in the order of `sum_order` (rank p's value first for part p), the
additions the in-place path makes, so the bits do not depend on which path a size takes and are
the same on every rank (up to the payload of a NaN that is the sum of two NaNs, see sum_order.py).

At a few bytes the transfers of cache lines between cores are most of the call, and a mailbox costs
two in a row: a peer fetches the counter's line, sees the count, then fetches the mailbox's. So:
- a tensor of up to `LINE_PAYLOAD_BYTES` rides in the sender's control line itself, after its
  arrival counter (shm_wait.py), in two slots that alternate like the mailboxes: a peer that sees
  the counter has the payload in the same transfer;
- a larger float32/float64 one of up to `LL_MAX_BYTES` is posted as flagged words by the C helper,
  after NCCL's LL ("low latency") protocol (`union ncclLLFifoLine`, src/include/device.h in
  NVIDIA/nccl): each 8-byte word holds a 4-byte piece of the tensor and
  the low 32 bits of the collective's number, so a peer waits on the words themselves and fetches
  all of the mailbox's lines at once. The counter is still stored after the words, for a peer that
  waits on it (the Python wait, a sleeper). These mailboxes are apart from the others, in the
  control page, and hold nothing but flagged words: a word left from an earlier collective carries
  that one's number, where a mailbox shared with plain payloads could hold any bit pattern, the
  current number among them. (A stale word passes for a fresh one only after exactly a multiple of
  2**32 collectives in between.)
Flagged words are the C helper's alone: in Python, gathering the pieces out of the words cost more
than the transfer saved (28-256 B 4.6 against 2.6 us a call). A transport takes the C path on every
rank or on none (`SharedMemoryTransport`), so every rank lays out a tensor alike.

For float32 and float64 the whole call is one call into C where the helper could be built
(shm_native.py, shm_small.c): the same copy, counter and additions, without ~20 Python calls.
"""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dpscale.comm.base import completed
from dpscale.comm.shm_native import Helper, Plan, Wait
from dpscale.comm.shm_wait import Counters
from dpscale.comm.sum_order import ranges_in_order, sum_into

# Tensors up to this size take the one-round path (0 turns it off). It copies the tensor in and
# every rank reads all ranks' copies (world_size times the bytes each rank reads in place), so past
# a few KiB the second barrier is the cheaper price; where on a host: benchmarks/shm_ab.py
# --small-max-bytes.
SMALL_MAX_BYTES = 1 << 13
# The limit for float32/float64 where the C helper runs them. Its one round saves a barrier but
# moves world_size copies across cores where the in-place path moves one, so past ~10 KiB the
# in-place path is faster: 2 ranks, shm_ab.py block against inplace, 2026-12-03, 0.93x at 10 KiB,
# 1.05x at 12 KiB, 1.28x at 16 KiB, 2.9x at 64 KiB (BENCHMARKS.md, "Small messages in one round").
NATIVE_SMALL_MAX_BYTES = 10 << 10
# The same limit where the ranks share CPUs: every barrier then costs switches between processes
# (tens of us), so the barrier saved outweighs reading world_size copies further up. 4 ranks on 2
# cores, one round against in place: 16 KiB 28 against 63 us, 64 KiB 58 against 63 (53 against
# 62 in a second run), 128 KiB 96 against 71 (BENCHMARKS.md, "4 ranks on 2 cores").
NATIVE_SMALL_MAX_BYTES_SHARED_CPUS = 64 << 10
# summed with numpy (a fraction of torch's per-call cost); other dtypes through torch (`sum_into`)
_NUMPY_DTYPES = (torch.float32, torch.float64)
# summed by the C helper, with its dtype code (shm_small.c)
_NATIVE_DTYPES = {torch.float32: 0, torch.float64: 1}
_WHAT = "all_reduce: inputs posted"
# Payloads up to this size go in the control line (64 B: the 8 B counter, two 24 B slots; 24 keeps
# float64 aligned), at these byte offsets, by the parity of the collective as the mailboxes. (Below
# it flagged words were slower, 0.75-0.78 against 0.70-0.72 us: they take a line besides the
# counter's.)
LINE_PAYLOAD_BYTES = 24
_LINE_SLOTS = (8, 32)
# Larger float32/float64 tensors up to this size are posted as flagged words by the C helper, twice
# their size in the mailbox. 2 ranks, against plain mailboxes in the same runs (BENCHMARKS.md,
# "Flagged words"): 28 B 0.72-0.73 against 0.87-0.90 us, 64 B 0.72 against 0.87-0.90, 128 B 0.78
# against 0.90-0.91, 256 B 0.85-0.86 against 0.92-0.93; past it the doubled bytes cost what the
# transfer saves (512 B level, 1-2 KiB 5-10% slower in a C harness)
LL_MAX_BYTES = 256
# The same where the ranks share CPUs: 4 ranks on 2 cores, the time at 64 B against 4 B was the same
# with flagged words as without (0.96x against 1.03x), but 1.10x against 0.98x at 128 B and 1.23x
# against 1.05x at 256 B (6 runs each, in both orders)
LL_MAX_BYTES_SHARED_CPUS = 64
# their two mailboxes, in the control page (after the control lines, before `offset`), by parity
_LL_SLOTS = (2048, 3072)
_LL_BOX_BYTES = 1024  # flagged words of up to 512 B
# Operand lists remembered at most (by size and dtype; a job reduces a fixed set of them)
_MAX_SHAPES = 1024


@dataclass(frozen=True)
class _Terms:
    """What the one-round sum of a (numel, dtype) reads: the ranges [lo, hi) added in one order
    (`sum_order.ranges_in_order`), and per mailbox slot my mailbox as bytes and for every range
    the ranks' copies of it in the order they are added; `in_line`: the mailboxes are the slots in
    the control lines (a tensor of <= LINE_PAYLOAD_BYTES). With flagged words (`ll`, summed by the
    C helper alone) my mailboxes are uint32 arrays (piece, flag, piece, flag, ...) and there are no
    copies."""

    bounds: list[tuple[int, int]]
    inboxes: tuple[np.ndarray, np.ndarray]
    copies: tuple[list[list], list[list]]
    orders: list[list[int]]
    in_line: bool
    ll: bool


@dataclass(frozen=True)
class NativeCalls:
    """How the one-round path runs in C: the loaded helper, whether an arriving rank wakes peers
    asleep on it (the `block` wait), and how it waits for its peers before the Python wait policy
    takes over (`wait`: spin and yield budgets from shm_wait.Counters, shared by every plan)."""

    helper: Helper
    wake: bool
    wait: Wait


class Mailboxes:
    """Every rank's two mailboxes of `capacity` bytes, at `offset` in its control segment
    (`maps[j]` is rank j's, mapped here; its first bytes are rank j's control line, which holds
    two more mailboxes of `LINE_PAYLOAD_BYTES` for the smallest tensors, and the rest of the page
    before `offset` two for flagged words). With `native`
    the float32/float64 all-reduces run in the C helper, up to `capacity` bytes; the rest up to
    `python_max_bytes` (default: `capacity`). The C helper posts those of `LINE_PAYLOAD_BYTES` <
    size <= `ll_max_bytes` as flagged words."""

    def __init__(
        self,
        maps: list[mmap.mmap],
        offset: int,
        capacity: int,
        rank: int,
        native: NativeCalls | None = None,
        python_max_bytes: int | None = None,
        ll_max_bytes: int = LL_MAX_BYTES,
    ):
        self.capacity = capacity
        if 2 * ll_max_bytes > _LL_BOX_BYTES or offset < _LL_SLOTS[1] + _LL_BOX_BYTES:
            raise ValueError(f"Mailboxes: no room for flagged words of {ll_max_bytes} B before {offset}")
        self.ll_max_bytes = ll_max_bytes
        self.python_max_bytes = capacity if python_max_bytes is None else min(python_max_bytes, capacity)
        self.rank = rank
        self.world_size = len(maps)
        # boxes[slot][j]: rank j's mailbox `slot`, as bytes (none when the path is turned off)
        starts = (offset, offset + capacity)
        self.boxes = [[_bytes(m, at, capacity) for m in maps] for at in starts] if capacity else []
        # the same, in the control lines (line_boxes[slot][j]), for tensors of <= LINE_PAYLOAD_BYTES
        self.line_boxes = (
            [[_bytes(m, at, LINE_PAYLOAD_BYTES) for m in maps] for at in _LINE_SLOTS] if capacity else []
        )
        self._terms: dict[tuple[int, torch.dtype], _Terms] = {}
        self.native = native if capacity else None
        # and the flagged words' (ll_boxes[slot][j]), which only the C helper posts
        self.ll_boxes = (
            [[_bytes(m, at, _LL_BOX_BYTES) for m in maps] for at in _LL_SLOTS]
            if self.native is not None
            else []
        )
        if self.native is not None:
            # the C helper's view of the layout: control lines and mailboxes by address
            lines = [_bytes(m, 0, 8).data_ptr() for m in maps]
            self._lines = (ctypes.c_void_p * len(maps))(*lines)
            self._boxes = _addresses(self.boxes)
            self._line_boxes = _addresses(self.line_boxes)
            self._ll_boxes = _addresses(self.ll_boxes)

    def fits(self, tensor: torch.Tensor) -> bool:
        in_c = self.native is not None and tensor.dtype in _NATIVE_DTYPES
        return (
            self.world_size > 1
            and self.capacity > 0
            and tensor.numel() * tensor.element_size() <= (self.capacity if in_c else self.python_max_bytes)
            and tensor.is_contiguous()
            and tensor.device.type == "cpu"
        )

    def bind(self, tensor: torch.Tensor) -> SmallAllReduce:
        """The one-round all-reduce of `tensor` (which `fits`), in place."""
        terms = self._terms_of(tensor.numel(), tensor.dtype)
        native = None
        if self.native is not None and tensor.dtype in _NATIVE_DTYPES:
            native = _NativeCall(self.native, self._plan(tensor, terms))
        return SmallAllReduce(tensor, terms, native)

    def _plan(self, tensor: torch.Tensor, terms: _Terms) -> _PlanRefs:
        assert self.native is not None
        flat = tensor.detach().view(-1)
        flat_bounds = [i for b in terms.bounds for i in b]
        flat_orders = [j for o in terms.orders for j in o]
        boxes = self._line_boxes if terms.in_line else self._ll_boxes if terms.ll else self._boxes
        bounds = (ctypes.c_int64 * len(flat_bounds))(*flat_bounds)
        orders = (ctypes.c_int32 * len(flat_orders))(*flat_orders)
        plan = Plan(
            lines=ctypes.addressof(self._lines),
            boxes=ctypes.addressof(boxes),
            tensor=flat.data_ptr(),
            nbytes=flat.numel() * flat.element_size(),
            bounds=ctypes.addressof(bounds),
            orders=ctypes.addressof(orders),
            nranges=len(terms.bounds),
            world=self.world_size,
            rank=self.rank,
            dtype=_NATIVE_DTYPES[flat.dtype],
            wake=int(self.native.wake),
            ll=int(terms.ll),
            wait=ctypes.addressof(self.native.wait),
        )
        # everything the plan points to, kept alive as long as it
        mailboxes = (self.boxes, self.line_boxes, self.ll_boxes)
        keep = (self._lines, boxes, mailboxes, bounds, orders, flat, self.native.wait)
        return _PlanRefs(plan, keep)

    def waiter(self, wait: Wait) -> _NativeCall:
        """The C helper's wait alone (`wait_all(plan, seq)`), for barriers, with a budget of its
        own: a plan of this layout over no tensor."""
        assert self.native is not None
        plan = Plan(
            lines=ctypes.addressof(self._lines),
            world=self.world_size,
            rank=self.rank,
            wait=ctypes.addressof(wait),
        )
        native = NativeCalls(self.native.helper, self.native.wake, wait)
        return _NativeCall(native, _PlanRefs(plan, (self._lines, wait)))

    def _terms_of(self, numel: int, dtype: torch.dtype) -> _Terms:
        key = (numel, dtype)
        terms = self._terms.get(key)
        if terms is None:
            if len(self._terms) >= _MAX_SHAPES:
                self._terms.clear()
            terms = self._terms[key] = self._new_terms(numel, dtype)
        return terms

    def _new_terms(self, numel: int, dtype: torch.dtype) -> _Terms:
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        ranges = ranges_in_order(numel, self.world_size)
        bounds = [(lo, hi) for lo, hi, _ in ranges]
        orders = [order for _, _, order in ranges]
        if self.flagged(nbytes, dtype):
            words = [boxes[self.rank][: 2 * nbytes].numpy().view(np.uint32) for boxes in self.ll_boxes]
            return _Terms(bounds, (words[0], words[1]), ([], []), orders, in_line=False, ll=True)
        in_line = nbytes <= LINE_PAYLOAD_BYTES
        inboxes, copies = [], []
        for boxes in self.line_boxes if in_line else self.boxes:
            inboxes.append(boxes[self.rank][:nbytes].numpy())
            copies.append(_copies([box[:nbytes].view(dtype) for box in boxes], dtype, ranges))
        return _Terms(bounds, (inboxes[0], inboxes[1]), (copies[0], copies[1]), orders, in_line, ll=False)

    def flagged(self, nbytes: int, dtype: torch.dtype) -> bool:
        """Whether a tensor of `nbytes` and `dtype` is posted as flagged words (by the C helper;
        its dtypes are whole 4-byte pieces)."""
        return (
            self.native is not None
            and dtype in _NATIVE_DTYPES
            and LINE_PAYLOAD_BYTES < nbytes <= self.ll_max_bytes
        )


def _copies(ranks: list[torch.Tensor], dtype: torch.dtype, ranges: list) -> list[list]:
    """For every range, the ranks' copies of it (`ranks[j]`: rank j's whole tensor) in the order
    they are added; as numpy arrays where numpy sums."""
    views: list[Any] = [c.numpy() for c in ranks] if dtype in _NUMPY_DTYPES else ranks
    return [[views[j][lo:hi] for j in order] for lo, hi, order in ranges]


@dataclass(frozen=True)
class _PlanRefs:
    plan: Plan
    keep: tuple  # what the plan's pointers point into


class _NativeCall:
    """A bound plan and the helper's calls on it, looked up once, with the wait it points to."""

    def __init__(self, native: NativeCalls, refs: _PlanRefs):
        self.refs = refs
        self.plan = native.helper.plan_arg(refs.plan)
        self.all_reduce = native.helper.all_reduce
        self.sum = native.helper.sum
        self.wait_all = native.helper.wait_all
        self.wait = native.wait


class SmallAllReduce:
    """The one-round all-reduce of one tensor: `run(counters)` does it all; its steps, for tests:
    `post(seq)` copies it into my mailbox for collective `seq` (its parity's); once every peer has
    posted, `sum(seq & 1)` writes the sum of all those mailboxes into it. With the C helper
    (`native`), a caller may instead call `native.all_reduce(native.plan)` itself and, if that
    returns 1, `finish(counters)`: what `run` does, one Python call fewer (the transport's hot path,
    shm.py)."""

    def __init__(self, tensor: torch.Tensor, terms: _Terms, native: _NativeCall | None = None):
        self.native = native
        # the last tensor reduced through this binding and its completed Future (`completed`)
        self.tensor = tensor
        self.future = completed(tensor)
        flat = tensor.detach().view(-1)
        self._source = flat.view(torch.uint8).numpy()
        self._inboxes = terms.inboxes
        self._ll = terms.ll
        self._numpy = flat.dtype in _NUMPY_DTYPES
        if terms.ll:  # the C helper sums
            self._source = self._source.view(np.uint32)
            return
        if self._numpy:
            # per slot, the additions as (a, b, out) in order: one flat loop of numpy calls, whose
            # ~0.5 us each is most of a small all-reduce's time
            out = flat.numpy()
            self._adds = tuple(_numpy_adds(out, terms.bounds, copies) for copies in terms.copies)
        else:
            parts = [flat[lo:hi] for lo, hi in terms.bounds]
            self._sums = tuple(list(zip(parts, copies, strict=True)) for copies in terms.copies)

    def run(self, counters: Counters) -> None:
        """The all-reduce: post, arrive, wait for every peer (`counters`' policy), sum."""
        native = self.native
        if native is not None:
            if native.all_reduce(native.plan):
                self.finish(counters)
            return
        seq = counters.seq + 1  # the arrival this call makes
        self.post(seq)
        counters.wait_all(counters.arrive(), _WHAT)
        self.sum(seq & 1)

    def finish(self, counters: Counters) -> None:
        """After the C helper's call returned 1 (a peer did not arrive within its spin): wait for
        every peer with `counters`' policy, then sum."""
        assert self.native is not None
        seq = counters.seq  # the helper's arrival
        counters.wait_all(seq, _WHAT)
        self.native.sum(self.native.plan, seq & 1)

    def completed(self, tensor: torch.Tensor) -> torch.futures.Future:
        """A completed Future of `tensor`, the same one while the caller passes the same tensor (a
        completed Future runs callbacks added later at once and keeps none, so one serves all)."""
        if tensor is not self.tensor:
            self.tensor, self.future = tensor, completed(tensor)
        return self.future

    def post(self, seq: int) -> None:
        inbox = self._inboxes[seq & 1]
        if self._ll:
            # every piece before any flag: a peer that sees a word's flag has its piece (x86-64
            # keeps stores in order)
            np.copyto(inbox[0::2], self._source)
            inbox[1::2] = seq & 0xFFFFFFFF
            return
        np.copyto(inbox, self._source)

    def sum(self, slot: int) -> None:
        if self.native is not None:
            self.native.sum(self.native.plan, slot)
            return
        if self._numpy:
            # the additions of sum_into, with numpy's cheaper calls (the same IEEE adds in the same order)
            for a, b, out in self._adds[slot]:
                np.add(a, b, out=out)
            return
        for part, copies in self._sums[slot]:
            sum_into(part, copies)


def _numpy_adds(out: np.ndarray, bounds: list[tuple[int, int]], copies: list[list]) -> list[tuple]:
    adds = []
    for (lo, hi), (first, second, *rest) in zip(bounds, copies, strict=True):
        acc = out[lo:hi]
        adds.append((first, second, acc))
        adds += [(acc, c, acc) for c in rest]
    return adds


def _addresses(boxes: list[list[torch.Tensor]]) -> ctypes.Array:
    """boxes[slot][j]'s addresses, slot by slot, as the C helper's `boxes` array."""
    flat = [b.data_ptr() for bs in boxes for b in bs]
    return (ctypes.c_void_p * len(flat))(*flat)


def _bytes(m: mmap.mmap, offset: int, count: int) -> torch.Tensor:
    return torch.frombuffer(m, dtype=torch.uint8, count=count, offset=offset)
