"""Data-parallel training written the way DDP scripts are written, with dpscale's engine and sampler.

Run with:  torchrun --standalone --nproc-per-node 2 examples/train_ddp_style.py
"""

import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dpscale
from dpscale.data import GlobalBatchSampler
from dpscale.workloads.datasets import digits

GLOBAL_BATCH = 64  # samples per optimizer step, across all workers
ACCUMULATION = 2  # micro-batches per worker per step: each is 64 / (world * 2) samples
EPOCHS = 20


def main() -> None:
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(0)  # same initial weights on every rank (rank 0's are broadcast anyway)
    train, test = digits(seed=0)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    model = dpscale.DistributedDataParallel(net)  # was: torch.nn.parallel.DistributedDataParallel
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = GlobalBatchSampler(
        len(train),
        global_batch=GLOBAL_BATCH,
        world_size=world,
        rank=rank,
        accumulation_steps=ACCUMULATION,
        seed=0,
    )
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for step in sampler.iter_steps():
            for i, indices in enumerate(step.micro_batches):
                x, y = train.batch(indices)
                last = i == len(step.micro_batches) - 1
                with nullcontext() if last else model.no_sync():  # reduce only on the last micro-batch
                    # sum over my samples, scaled so that the engine's average over ranks is the
                    # mean over the whole global batch
                    loss = F.cross_entropy(model(x), y, reduction="sum") * world / step.global_count
                    loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    if rank == 0:
        with torch.no_grad():
            accuracy = (net(test.x).argmax(1) == test.y).float().mean().item()
        print(f"epochs {EPOCHS}  world {world}  test accuracy {accuracy:.2%}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
