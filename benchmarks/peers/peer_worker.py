"""One rank of one all-reduce peer, started by allreduce_peers.py with that peer's own interpreter.

    python peer_worker.py --peer NAME --ctl DIR [--rank R --world N] --threads T --max-bytes B

Runs under any of the peers' environments, so it imports only the standard library, numpy and the
peer's own library. The driver talks to each rank through two named pipes in DIR (`cmd.R`, which
this rank reads, and `res.R`, which it writes), one JSON document a line: never through the peer's
collectives, so a rank waiting for the next round blocks in `read` and burns no CPU (an MPI rank
waiting in a broadcast would spin through the other peers' rounds).

Lines: this rank writes {"ready": ..., "info": {...}} after set-up; then for each command
{"sizes": [bytes], "iters": [n], "warmup": w, "check": bool} it all-reduces a float32 buffer of each
size in place, `warmup` untimed calls then `iters` timed ones, and writes {"times_s": [[...], ...]}
(per size, per call, this rank's wall time); {"quit": true} ends it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import numpy as np

ELEMENT = 4  # float32


class Peer:
    """A peer's all-reduce over prefixes of one float32 buffer of `max_bytes` (in place)."""

    rank: int
    world: int
    info: dict

    def views(self, numel: int) -> tuple[Callable[[], None], np.ndarray]:
        """(all-reduce of the first `numel` elements, a numpy view of them)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


def _torch_group(args, threads: int):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world, timeout=timedelta(hours=2))
    return torch, dist


def _gloo_shm_in_build(torch) -> bool:
    """Whether this torch's gloo has the shared-memory all-reduce (gloo PR #458): its code reads
    LOCAL_WORLD_SIZE, a name that appears nowhere else in libtorch_cpu."""
    import mmap

    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return m.find(b"LOCAL_WORLD_SIZE") >= 0


class GlooPeer(Peer):
    def __init__(self, args):
        torch, dist = _torch_group(args, args.threads)
        self.dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.buf = torch.zeros(args.max_bytes // ELEMENT, dtype=torch.float32)
        self.info = {
            "torch": torch.__version__,
            "LOCAL_WORLD_SIZE": os.environ.get("LOCAL_WORLD_SIZE"),
            "gloo_shm_allreduce_in_build": _gloo_shm_in_build(torch),
        }

    def views(self, numel):
        t = self.buf[:numel]
        return (lambda: self.dist.all_reduce(t)), t.numpy()

    def close(self):
        self.dist.destroy_process_group()


class DpscalePeer(Peer):
    """dpscale's shm transport; `in_segment`: the buffer lives in its shared segments (how the
    engine's gradient buckets are reduced), else a plain tensor it stages in and out."""

    def __init__(self, args, in_segment: bool):
        torch, dist = _torch_group(args, args.threads)
        import dpscale
        from dpscale.comm import SharedMemoryTransport

        self.dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.transport = SharedMemoryTransport(timeout_s=600, wait=args.wait)
        numel = args.max_bytes // ELEMENT
        if in_segment:
            self.buf = self.transport.alloc(numel, torch.float32)
        else:
            self.buf = torch.zeros(numel, dtype=torch.float32)
        self.info = {"torch": torch.__version__, "dpscale": dpscale.__version__, "wait": args.wait}

    def views(self, numel):
        t = self.buf[:numel]
        return (lambda: self.transport.all_reduce(t)), t.numpy()

    def close(self):
        self.transport.close()
        self.dist.destroy_process_group()


class DeepSpeedPeer(Peer):
    """DeepSpeed's CPU shared-memory all-reduce (`deepspeed.comm.inference_all_reduce`), called as
    its op (torch.ops.deepspeed.inference_all_reduce_) so no Python wrapper is timed."""

    def __init__(self, args):
        import deepspeed
        import deepspeed.comm as dc
        import torch

        torch.set_num_threads(args.threads)
        deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(hours=2))
        cdb = dc.comm.cdb
        level = getattr(cdb, "shm_vector_kernel_level", 0)
        if cdb.shm_comm_op is None or level < 1:
            raise SystemExit(
                f"deepspeed: its shm all-reduce op is not in use (op {cdb.shm_comm_op}, ISA level "
                f"{level}); it needs DS_ACCELERATOR=cpu, LOCAL_SIZE=world size, gcc and AVX2"
            )
        self.dist = torch.distributed
        self.op = torch.ops.deepspeed.inference_all_reduce_
        self.rank, self.world = self.dist.get_rank(), self.dist.get_world_size()
        self.buf = torch.zeros(args.max_bytes // ELEMENT, dtype=torch.float32)
        self.info = {"torch": torch.__version__, "deepspeed": deepspeed.__version__, "isa_level": level}

    def views(self, numel):
        t = self.buf[:numel]
        return (lambda: self.op(t)), t.numpy()

    def close(self):
        self.dist.destroy_process_group()


class MpiPeer(Peer):
    def __init__(self, args):
        from mpi4py import MPI

        self.mpi = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.world = self.comm.Get_rank(), self.comm.Get_size()
        self.buf = np.zeros(args.max_bytes // ELEMENT, dtype=np.float32)
        import mpi4py

        self.info = {
            "mpi4py": mpi4py.__version__,
            "mpi": MPI.Get_library_version().splitlines()[0].strip("\x00 "),
        }

    def views(self, numel):
        a = self.buf[:numel]
        in_place, op, comm = self.mpi.IN_PLACE, self.mpi.SUM, self.comm
        return (lambda: comm.Allreduce(in_place, a, op=op)), a


def _make(args) -> Peer:
    if args.peer == "mpi":
        return MpiPeer(args)
    if args.peer.startswith("gloo"):
        return GlooPeer(args)
    if args.peer == "deepspeed":
        return DeepSpeedPeer(args)
    if args.peer in ("dpscale", "dpscale-base", "dpscale-staged"):
        return DpscalePeer(args, in_segment=args.peer != "dpscale-staged")
    raise SystemExit(f"peer_worker: unknown peer {args.peer!r}")


def _check(peer: Peer, numel: int) -> str | None:
    """One all-reduce of rank + 1 everywhere must give n(n+1)/2 (exact in float32)."""
    fn, a = peer.views(numel)
    a.fill(peer.rank + 1)
    fn()
    want = peer.world * (peer.world + 1) / 2
    bad = None if bool((a == want).all()) else f"{numel * ELEMENT} B: got [{a.min()}, {a.max()}], want {want}"
    a.fill(0)
    return bad


def _sweep(peer: Peer, cmd: dict) -> dict:
    out, errors = [], []
    for nbytes, iters in zip(cmd["sizes"], cmd["iters"], strict=True):
        numel = max(1, nbytes // ELEMENT)
        if cmd.get("check") and (err := _check(peer, numel)):
            errors.append(err)
        fn, a = peer.views(numel)
        # zeros: repeated in-place sums of anything else grow n-fold a call (to inf, via denormals)
        a.fill(0)
        for _ in range(cmd["warmup"]):
            fn()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out.append(times)
    return {"times_s": out, "errors": errors}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", required=True)
    parser.add_argument("--ctl", required=True, help="folder of the driver's named pipes")
    parser.add_argument("--rank", type=int, default=-1, help="(torch peers) this rank")
    parser.add_argument("--world", type=int, default=-1, help="(torch peers) the world size")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-bytes", type=int, required=True)
    parser.add_argument("--wait", default="block", help="(dpscale) shm wait policy")
    args = parser.parse_args()
    if args.peer == "mpi":
        from mpi4py import MPI

        args.rank = MPI.COMM_WORLD.Get_rank()
    # open order matches the driver's (cmd, then res), so neither side waits on the other forever
    with (
        open(os.path.join(args.ctl, f"cmd.{args.rank}")) as cmd_in,
        open(os.path.join(args.ctl, f"res.{args.rank}"), "w") as res_out,
    ):
        peer = _make(args)

        def say(doc: dict) -> None:
            res_out.write(json.dumps(doc) + "\n")
            res_out.flush()

        say({"ready": True, "rank": peer.rank, "world": peer.world, "info": peer.info, "pid": os.getpid()})
        for line in cmd_in:
            cmd = json.loads(line)
            if cmd.get("quit"):
                break
            say(_sweep(peer, cmd))
        peer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
