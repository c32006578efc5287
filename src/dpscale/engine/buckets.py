"""Gradient buckets: which parameters share a flat buffer, the buffers, and each bucket's step.

The layout and each bucket's per-step state (gradients still pending, its reduction's future and
timing, its local gradient norm) live here; when a bucket is launched is decided in `reducer.py`
and how it is reduced in `hooks.py`, so changing one (say, fp16 compression) never touches the
others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dpscale.engine.stats import BucketTiming

if TYPE_CHECKING:
    from dpscale.engine.grad_pool import GradPool

MB = 1024 * 1024


def assign_buckets(
    params: list[torch.Tensor], bucket_cap_bytes: int, first_bucket_cap_bytes: int
) -> list[list[int]]:
    """Group parameter indices into buckets; returns lists of indices into `params`.

    Parameters are taken in reverse registration order because backward produces gradients
    roughly from the last layer to the first: the first bucket fills first, so its all-reduce
    can start while the rest of backward still runs. The first bucket is small (`first_bucket_cap_bytes`)
    so communication starts early; later buckets are large so that per-message latency is paid
    rarely. A bucket holds one device and dtype only (a flat buffer has one of each); a parameter
    larger than the cap gets a bucket of its own.
    """
    if bucket_cap_bytes <= 0 or first_bucket_cap_bytes <= 0:
        raise ValueError("bucket caps must be positive")
    buckets: list[list[int]] = []
    # one open bucket per (device, dtype), so interleaved dtypes do not fragment the layout
    open_buckets: dict[tuple, tuple[list[int], int]] = {}
    for i in reversed(range(len(params))):
        p = params[i]
        key = (p.device, p.dtype)
        nbytes = p.numel() * p.element_size()
        cap = first_bucket_cap_bytes if not buckets else bucket_cap_bytes
        idxs, size = open_buckets.get(key, ([], 0))
        if idxs and size + nbytes > cap:
            buckets.append(idxs)
            idxs, size = [], 0
            cap = bucket_cap_bytes
        idxs.append(i)
        size += nbytes
        if size >= cap:
            buckets.append(idxs)
            idxs, size = [], 0
        open_buckets[key] = (idxs, size)
    buckets.extend(idxs for idxs, _ in open_buckets.values() if idxs)
    return buckets


def assign_buckets_of(
    params: list[torch.Tensor], indices: list[int], bucket_cap_mb: float, first_bucket_cap_mb: float
) -> list[list[int]]:
    """`assign_buckets` over `params[i] for i in indices` (the dense ones), as indices into `params`."""
    chosen = [params[i] for i in indices]
    buckets = assign_buckets(chosen, int(bucket_cap_mb * MB), int(first_bucket_cap_mb * MB))
    return [[indices[j] for j in b] for b in buckets]


@dataclass(eq=False)
class Bucket:
    """A flat gradient buffer and the parameters whose gradients are views into it."""

    index: int
    param_indices: list[int]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    offsets: list[int]
    # set by the reducer with the layout: the parameters in bucket order, whether the bucket is one
    # of small tensors (see Reducer._preset_grads) and, for such a bucket with
    # gradient_as_bucket_view=False, the pool its `.grad`s are views of (grad_pool.py)
    members: list[torch.nn.Parameter] = field(default_factory=list)
    small: bool = False
    pool: GradPool | None = None
    # per step (begin_step): gradients not yet in, the reduction's future and timing
    pending: int = 0
    future: torch.Future | None = None  # torch.futures.Future or a Work's C++ future
    timing: BucketTiming | None = None
    # which gradients are divided in place at launch (True: all, False: none, else their
    # positions), see Reducer._preset_grads
    in_place: bool | set[int] = False
    # when the noise scale is measured: position -> that large tensor's local squared norm, and
    # the bucket's local squared norm once launched
    tensor_sq: dict[int, torch.Tensor] = field(default_factory=dict)
    local_sq: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def begin_step(self) -> None:
        """Reset the per-step state before a synced backward."""
        self.pending = len(self.param_indices)
        self.future = None
        self.timing = BucketTiming(self.index, self.nbytes)
        self.tensor_sq = {}
        self.local_sq = None


def build_buckets(params: list[torch.Tensor], assignment: list[list[int]], alloc=None) -> list[Bucket]:
    """One flat zeroed buffer per bucket and a view shaped like each of its parameters.

    `alloc(numel, dtype, device)` provides the buffers (a transport's, so that e.g. shared-memory
    buffers are reduced where they are); default: ordinary zeroed tensors.
    """
    alloc = alloc or (lambda n, dtype, device: torch.zeros(n, dtype=dtype, device=device))
    buckets = []
    for b, idxs in enumerate(assignment):
        first = params[idxs[0]]
        total = sum(params[i].numel() for i in idxs)
        buffer = alloc(total, first.dtype, first.device)
        views, offsets, off = [], [], 0
        for i in idxs:
            n = params[i].numel()
            views.append(buffer[off : off + n].view_as(params[i]))
            offsets.append(off)
            off += n
        buckets.append(Bucket(index=b, param_indices=list(idxs), buffer=buffer, views=views, offsets=offsets))
    return buckets
