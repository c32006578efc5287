"""A script in pytorch/examples' imagenet style: DDP only when world_size > 1 (never with --never-wrap,
as imagenet's main.py on CPU), an evaluation every --eval-every and a checkpoint every --save-every steps.

    torchrun --nproc-per-node 2 wrap_if_distributed.py --steps 40
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--never-wrap", action="store_true")
parser.add_argument("--eval-every", type=int, default=0)
parser.add_argument("--save-every", type=int, default=0)
args = parser.parse_args()

world_size = int(os.environ.get("WORLD_SIZE", "1"))
distributed = world_size > 1
if distributed:
    dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
if distributed and not args.never_wrap:
    model = nn.parallel.DistributedDataParallel(model)
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
torch.manual_seed(1 + int(os.environ.get("RANK", "0")))
for step in range(args.steps):
    x, y = torch.randn(args.batch, 32), torch.randint(0, 4, (args.batch,))
    loss = criterion(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if args.eval_every and step % args.eval_every == args.eval_every - 1:
        model.eval()
        with torch.no_grad():
            for _ in range(20):
                criterion(model(torch.randn(256, 32)), torch.randint(0, 4, (256,)))
        model.train()
    if args.save_every and step % args.save_every == args.save_every - 1:
        torch.save(model.state_dict(), os.devnull)
print(f"done: loss {loss.item():.4f}")
if distributed:
    dist.destroy_process_group()
