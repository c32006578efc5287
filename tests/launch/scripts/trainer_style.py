"""A script in the style of Hugging Face's Trainer (which trains through Accelerate), written here:
the process group and DDP only when world_size > 1 (`Accelerator.prepare`), a dict of inputs passed
as keyword arguments to a model that computes its own loss, accumulation with every micro-step but
the last under `no_sync()`, and evaluation on the bare model: the Trainer evaluates `self.model`,
which DDP never wrapped (it wraps only to train), so no evaluation forward reaches the DDP wrapper.

    torchrun --nproc-per-node 2 trainer_style.py --steps 40 --eval-every 5
"""

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--accumulation", type=int, default=2)
parser.add_argument("--eval-every", type=int, default=0)
args = parser.parse_args()


class TinyLM(nn.Module):
    """Embedding, one hidden layer, a head; returns {"loss", "logits"} as a transformers model does."""

    def __init__(self, vocab: int = 64, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, labels=None):
        logits = self.head(torch.relu(self.hidden(self.embed(input_ids))))
        loss = None if labels is None else nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def batch(n: int) -> dict:
    ids = torch.randint(0, 64, (n, 16))
    return {"input_ids": ids, "labels": ids.roll(-1, 1)}


world_size = int(os.environ.get("WORLD_SIZE", "1"))
if world_size > 1:
    dist.init_process_group("gloo")
torch.manual_seed(0)
model = TinyLM()  # the Trainer's self.model
wrapped = nn.parallel.DistributedDataParallel(model) if world_size > 1 else model  # its model_wrapped
optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
torch.manual_seed(1 + int(os.environ.get("RANK", "0")))
for step in range(args.steps):
    for micro in range(args.accumulation):
        last = micro == args.accumulation - 1
        skip = world_size > 1 and not last  # Accelerator.no_sync: a no-op without DDP
        with wrapped.no_sync() if skip else contextlib.nullcontext():
            loss = wrapped(**batch(args.batch))["loss"] / args.accumulation
            loss.backward()
    optimizer.step()
    wrapped.zero_grad()
    if args.eval_every and step % args.eval_every == args.eval_every - 1:
        model.eval()
        with torch.no_grad():
            for _ in range(10):
                model(**batch(64))
        model.train()
print(f"done: rank {os.environ.get('RANK', '0')} loss {loss.item():.4f}")
if world_size > 1:
    dist.destroy_process_group()
