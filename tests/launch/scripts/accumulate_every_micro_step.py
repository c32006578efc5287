"""DDP with 4 accumulation micro-steps per optimizer step and no `no_sync`: every micro-step
all-reduces. With --no-sync-when-distributed it skips the sync of the first three at N > 1 only,
as Accelerate does (one process has no DDP to sync, so every micro-step counts as a synced step).

    torchrun --nproc-per-node 2 accumulate_every_micro_step.py
"""

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--micro-batch", type=int, default=8)
parser.add_argument("--accumulation", type=int, default=4)
parser.add_argument("--no-sync-when-distributed", action="store_true")
args = parser.parse_args()

dist.init_process_group("gloo")
distributed = dist.get_world_size() > 1
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(args.steps):
    for micro in range(args.accumulation):
        last = micro == args.accumulation - 1
        skip = args.no_sync_when_distributed and distributed and not last
        with model.no_sync() if skip else contextlib.nullcontext():
            loss = model(torch.randn(args.micro_batch, 32)).pow(2).mean() / args.accumulation
            loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(f"done: rank {os.environ.get('RANK')}")
dist.destroy_process_group()
