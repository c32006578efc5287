"""DDP where rank 1 sleeps --sleep-ms in every forward: a straggler whose compute is known.

torchrun --nproc-per-node 2 slow_rank_forward.py --sleep-ms 30
"""

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--sleep-ms", type=float, default=30.0)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x):
        if rank == 1:
            time.sleep(args.sleep_ms / 1e3)
        return self.body(x)


torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(Net())
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(args.steps):
    loss = model(torch.randn(16, 32)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
dist.destroy_process_group()
