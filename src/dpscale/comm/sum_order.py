"""How the shm transport adds the ranks' copies of a tensor: the order and precision of every
addition, which define a run's bits.

Element e of a tensor lies in part p (`chunk_bounds(numel, world_size, p)`); its sum is rank p's
value first, then the other ranks' in rank order (`part_order`). The in-place path (shm.py, rank p
sums part p) and the one-round path for small tensors (shm_small.py, every rank sums every part)
both follow it, so a tensor's result does not depend on which path its size takes.

Parts 0 and 1 are added in orders that differ only in their first two terms (x0 + x1 against
x1 + x0), and IEEE addition is commutative: the same value, bit for bit, with one exception. Where
both terms are NaN the result is a NaN either way, and x86 keeps the first operand's payload, so
its payload bits may be the other rank's. The one-round path sums parts 0 and 1 in one go
(`ranges_in_order`); no other bits differ.
"""

from __future__ import annotations

import torch

from dpscale.comm.base import chunk_bounds


def part_order(part: int, world_size: int) -> list[int]:
    """The ranks whose copies of part `part` are added, in the order they are added."""
    return [part] + [j for j in range(world_size) if j != part]


def ranges_in_order(numel: int, world_size: int) -> list[tuple[int, int, list[int]]]:
    """The non-empty ranges [lo, hi) of a tensor of `numel` elements whose elements are all added
    in one order, with that order: parts 0 and 1 as one range (see above), then every further part."""
    last = min(1, world_size - 1)
    ranges = [(0, chunk_bounds(numel, world_size, last)[1], part_order(0, world_size))]
    ranges += [(*chunk_bounds(numel, world_size, p), part_order(p, world_size)) for p in range(2, world_size)]
    return [(lo, hi, order) for lo, hi, order in ranges if hi > lo]


def sum_into(out: torch.Tensor, parts: list[torch.Tensor]) -> None:
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
