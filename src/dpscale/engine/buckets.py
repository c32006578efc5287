"""Gradient buckets: which parameters share a flat buffer, and the buffers themselves.

Only layout lives here. Readiness tracking is in `reducer.py` and communication in `hooks.py`,
so changing one (say, fp16 compression) never touches the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    # filled by the reducer each step
    pending: int = 0

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


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
