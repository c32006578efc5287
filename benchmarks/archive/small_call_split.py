"""Where a 4 B shm all-reduce's time goes: the whole call against the C helper's call alone.

    python benchmarks/archive/small_call_split.py [--rounds 3]

Two ranks (run_ranks), a 1-element float32 tensor in the transport's segment. Per rank and build
of the helper (`module`: the extension module; `ctypes`: the plain library, forced by making the
module's build fail), 3 repeats of 20,000 calls in a tight loop of: `full`, the transport's
`all_reduce(t)`; `c_only`, the bound helper call `native.all_reduce(plan)` (with the Python wait
if a peer is late); `lambda`, the whole call through a lambda, as the peers benchmark calls it.
Printed: rank 0's best of the repeats, us a call; the builds alternate in fresh ranks every round.
"""

from __future__ import annotations

import argparse
import time

import torch

from dpscale.lab.multirank import run_ranks

CALLS = 20_000


def _rank(rank: int, world: int, kind: str) -> tuple[str, bool, dict[str, float]]:
    from dpscale.comm import SharedMemoryTransport, shm_native

    if kind == "ctypes":

        def no_headers() -> tuple[str, ...]:
            raise OSError("ctypes forced")

        shm_native._module_flags = no_headers  # type: ignore[assignment]
    shm_native.library.cache_clear()
    transport = SharedMemoryTransport(timeout_s=60, wait="block")
    t = transport.alloc(1024, torch.float32)[:1]
    t.zero_()
    out: dict[str, list[float]] = {}
    for _ in range(3):
        for name in ("full", "c_only", "lambda"):
            transport.all_reduce(t)  # bound, and both ranks here
            small = transport._regions[(t.data_ptr(), t.numel(), t.dtype)].small
            native = small.native
            assert native is not None
            call, plan = native.all_reduce, native.plan
            whole = lambda: transport.all_reduce(t)  # noqa: E731 - as the peers benchmark times it
            t0 = time.perf_counter()
            if name == "full":
                for _ in range(CALLS):
                    transport.all_reduce(t)
            elif name == "c_only":
                for _ in range(CALLS):
                    if call(plan):
                        small.finish(transport._ctl)
            else:
                for _ in range(CALLS):
                    whole()
            out.setdefault(name, []).append((time.perf_counter() - t0) / CALLS * 1e6)
    helper = shm_native.library()
    transport.close()
    return kind, helper is not None and helper.module, {k: round(min(v), 3) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for _ in range(args.rounds):
        for kind in ("module", "ctypes"):
            got, module, us = run_ranks(_rank, 2, kind)[0]
            print(f"{got:6s} (module loaded: {module}): " + ", ".join(f"{k} {v} us" for k, v in us.items()))


if __name__ == "__main__":
    main()
