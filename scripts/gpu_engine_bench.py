"""One-GPU throughput of dpscale's engine vs torch DDP on NCCL (run by scripts/gpu-check.sh).

World size 1 measures the engine's own overhead on the GPU path (bucket copies, hooks, the
communication stream); with 2+ GPUs a second run uses world size 2. Engines alternate in
rounds; each step is timed with torch.cuda.synchronize around it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from dpscale import DistributedDataParallel  # noqa: E402
from dpscale.workloads import get_workload  # noqa: E402


def rank_main(rank: int, world: int, store_path: str, model_name: str, batch: int, rounds: int, q) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    w = get_workload(model_name)
    data, _ = w.build_data(0)
    x, y = (t.cuda() for t in data.batch(list(range(batch))))
    runs = {}
    for engine in ("dpscale", "torch", "local"):
        torch.manual_seed(0)
        m = w.build_model().cuda()
        if engine == "dpscale":
            m = DistributedDataParallel(m, device_ids=[rank])
        elif engine == "torch":
            m = nn.parallel.DistributedDataParallel(m, device_ids=[rank])
        runs[engine] = (m, torch.optim.SGD(m.parameters(), lr=1e-4, momentum=0.9))
    times = {e: [] for e in runs}
    for r in range(rounds + 2):  # two warm-up rounds
        for e in list(runs)[r % 3 :] + list(runs)[: r % 3]:
            m, opt = runs[e]
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                (w.loss_sum(m(x), y) / batch).backward()
                opt.step()
                torch.cuda.synchronize()
                if r >= 2:
                    times[e].append((time.perf_counter() - t0) * 1e3)
    if rank == 0:
        q.put({e: statistics.median(t) for e, t in times.items()})
    dist.destroy_process_group()


def measure(world: int, model: str, batch: int, rounds: int) -> dict:
    ctx = torch.multiprocessing.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [
            ctx.Process(target=rank_main, args=(r, world, os.path.join(d, "store"), model, batch, rounds, q))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        result = q.get(timeout=600)
        for p in procs:
            p.join(60)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="reports/gpu-check")
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 1
    rows = []
    worlds = [1] + ([2] if torch.cuda.device_count() >= 2 else [])
    for world in worlds:
        for model, batch in (("mlp", 1024), ("transformer", 64)):
            med = measure(world, model, batch, args.rounds)
            rows.append(
                {
                    "world_size": world,
                    "model": model,
                    "per_gpu_batch": batch,
                    **{f"{e}_ms": round(v, 3) for e, v in med.items()},
                    "ratio_dpscale_torch": round(med["dpscale"] / med["torch"], 3),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "engine-bench.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
