"""Where a small shm all-reduce's time goes: its pieces, timed one by one on two ranks.

    flock /tmp/dpscale-bench.lock python benchmarks/shm_pieces.py

Prints microseconds per call (median of 7 batches of 2,000 calls; both ranks) for:
- whole collectives of today's transport: an empty barrier round trip, all-reduce of 4 B, 4 KiB
  and 64 KiB (in the transport's segments);
- the operations one call of the first transport (before the small-message path) made on every
  all-reduce at world size 2: locating the tensor's views (a slice and a dtype view per rank),
  slicing the parts, torch.add, copy_, a completed torch Future;
- their replacements: a cached region's dict lookup, numpy add and copyto on the same memory.
Sum the pieces to see the per-call cost; the barrier round trip is what the peers' handshake costs.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np
import torch

from dpscale.comm import SharedMemoryTransport
from dpscale.comm.base import completed
from dpscale.lab.multirank import run_ranks

CALLS = 2000


def _per_call_us(fn) -> float:
    batches = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        batches.append((time.perf_counter() - t0) / CALLS * 1e6)
    return statistics.median(batches)


def _rank(rank: int, world: int) -> dict[str, float]:
    t = SharedMemoryTransport(timeout_s=60)
    out = {"barrier round trip": _per_call_us(t.barrier)}
    for nbytes in (4, 4096, 65536):
        buf = t.alloc(nbytes // 4, torch.float32)
        t.barrier()
        out[f"all_reduce {nbytes} B"] = _per_call_us(lambda buf=buf: t.all_reduce(buf))
    # the pieces, on a 4 KiB buffer's two halves (rank r's part of every rank's copy)
    seg = t.alloc(2048, torch.uint8)  # 512 float32 per rank
    raw = seg.view(torch.uint8)
    out["slice + view (x2 ranks)"] = _per_call_us(lambda: [raw[0:2048].view(torch.float32) for _ in range(2)])
    floats = raw.view(torch.float32)
    out["slice a part"] = _per_call_us(lambda: floats[0:256])
    a, b = floats[0:256], floats[256:512]
    out["torch.add(out=)"] = _per_call_us(lambda: torch.add(a, b, out=a))
    out["torch copy_"] = _per_call_us(lambda: b.copy_(a))
    out["completed Future"] = _per_call_us(lambda: completed(floats))
    key = (floats.data_ptr(), floats.numel(), floats.dtype)
    regions = {key: object()}
    out["region lookup (dict)"] = _per_call_us(
        lambda: regions.get((floats.data_ptr(), floats.numel(), floats.dtype))
    )
    na, nb = a.numpy(), b.numpy()
    out["numpy add(out=)"] = _per_call_us(lambda: np.add(na, nb, out=na))
    out["numpy copyto"] = _per_call_us(lambda: np.copyto(nb, na))
    t.barrier()
    t.close()
    return out


def main() -> None:
    load = os.getloadavg()[0]
    res = run_ranks(_rank, 2, timeout_s=600)
    after = os.getloadavg()[0]
    print(f"shm pieces, 2 ranks, us per call (rank 0, rank 1); load {load:.1f} before, {after:.1f} after")
    for k in res[0]:
        print(f"  {k:26s} {res[0][k]:8.2f} {res[1][k]:8.2f}")


if __name__ == "__main__":
    main()
