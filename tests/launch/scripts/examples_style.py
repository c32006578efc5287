"""A script in pytorch/examples' DDP style: a fixed learning rate and a fixed per-rank batch (so the
global batch grows with the world size), BatchNorm with --batch-norm, a layer that takes no part in
the loss with --unused-layer, the learning rate scaled by the world size with --scale-lr.

    torchrun --nproc-per-node 2 examples_style.py --batch-norm
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--batch-norm", action="store_true")
parser.add_argument("--unused-layer", action="store_true")
parser.add_argument("--scale-lr", action="store_true")
args = parser.parse_args()

dist.init_process_group("gloo")
world = dist.get_world_size()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        norm = nn.BatchNorm1d(64) if args.batch_norm else nn.Identity()
        self.body = nn.Sequential(nn.Linear(32, 64), norm, nn.ReLU(), nn.Linear(64, 4))
        self.aux_head = nn.Linear(64, 4) if args.unused_layer else None  # never called

    def forward(self, x):
        return self.body(x)


torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(Net())
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * (world if args.scale_lr else 1))
torch.manual_seed(1 + dist.get_rank())
for _ in range(args.steps):
    x, y = torch.randn(args.batch, 32), torch.randint(0, 4, (args.batch,))
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
dist.destroy_process_group()
