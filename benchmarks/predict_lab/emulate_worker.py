"""One worker of an emulated cluster (emulate.py starts it under torchrun): measure, then print on rank 0.

`python benchmarks/predict_lab/emulate_worker.py CONFIG_JSON`, in the environment torchrun sets. Three
measurements, each step or call counted at its slowest rank (what the next collective waits for):

1. all-reduce of float32 tensors of each size over gloo: median time of `iters` calls;
2. the bare model, every worker stepping at once with no communication: the compute with the same
   contention as training has (cores, memory), the input the prediction scales its profile by;
3. training steps of the same model in dpscale's engine with the configured transport.

2 and 3 alternate step by step, so that a change of the host's load in the middle of the run
slows both alike (the prediction takes its compute level from 2 to predict 3).

Rank 0 prints one JSON line: {"allreduce": [{"bytes", "time_us"}], "local_step_ms", "train_step_ms",
"train_comm_ms", "transport"}.
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _allreduce_times(sizes_bytes: list[int], iters: int) -> list[dict]:
    out = []
    for nbytes in sizes_bytes:
        x = torch.zeros(nbytes // 4)
        dist.all_reduce(x)  # warm-up: connections and buffers
        times = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(_slowest(time.perf_counter() - t0))
        out.append({"bytes": x.numel() * 4, "time_us": statistics.median(times) * 1e6})
    return out


def _timed_step(model, opt, x, y, loss_sum) -> float:
    """One synchronized step: the slowest rank's seconds."""
    dist.barrier()  # start together, as synchronized training does
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    (loss_sum(model(x), y) / len(x)).backward()
    opt.step()
    return _slowest(time.perf_counter() - t0)


def _alternating_step_times(local, ddp, batch, loss_sum, steps: int, warmup: int):
    """Step times in ms of the bare model and of the engine, one step of each in turn, and the
    engine's communication per step."""
    x, y = batch
    opts = [torch.optim.SGD(m.parameters(), lr=1e-4, momentum=0.9) for m in (local, ddp)]
    local_ms, train_ms, comm = [], [], []
    for s in range(warmup + steps):
        bare = _timed_step(local, opts[0], x, y, loss_sum)
        engine = _timed_step(ddp, opts[1], x, y, loss_sum)
        stats = getattr(ddp, "last_step_stats", None)
        if s >= warmup:
            local_ms.append(bare * 1e3)
            train_ms.append(engine * 1e3)
            if stats is not None:
                comm.append(stats.comm_ms)
    return local_ms, train_ms, comm


def main(argv: list[str] | None = None) -> int:
    from dpscale.engine import DistributedDataParallel
    from dpscale.workloads import get_workload

    cfg = json.loads((argv or sys.argv[1:])[0])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        allreduce = _allreduce_times(cfg["sizes_bytes"], cfg["iters"])
        workload = get_workload(cfg["model"])
        train, _ = workload.build_data(0)
        g = torch.Generator().manual_seed(100 + dist.get_rank())
        batch = train.batch(torch.randint(0, len(train), (cfg["per_worker_batch"],), generator=g).tolist())
        torch.manual_seed(0)
        local_model = workload.build_model()
        torch.manual_seed(0)
        ddp = DistributedDataParallel(workload.build_model(), transport=cfg["transport"])
        local, train_ms, comm_ms = _alternating_step_times(
            local_model, ddp, batch, workload.loss_sum, cfg["steps"], cfg["warmup"]
        )
        result = {
            "allreduce": allreduce,
            "local_step_ms": statistics.median(local),
            "train_step_ms": statistics.median(train_ms),
            "train_comm_ms": statistics.median(comm_ms) if comm_ms else None,
            "transport": ddp.transport.describe(),
        }
        if dist.get_rank() == 0:
            print(json.dumps(result), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # leave without interpreter teardown, like dpscale's own worker: a gloo thread kept alive past
    # destroy_process_group can abort the exit ("terminate called without an active exception")
    from dpscale.launch.process_life import exit_now

    exit_now(main())
