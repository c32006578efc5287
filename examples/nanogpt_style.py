"""A small GPT trained the way nanoGPT's train.py trains, on generated text (nothing downloaded).

Plain PyTorch DDP, nothing of dpscale in it; run it unchanged with either launcher:

    torchrun --standalone --nproc-per-node 2 examples/nanogpt_style.py
    dpscale run --nproc 2 examples/nanogpt_style.py            # dpscale's engine stands in for DDP
    dpscale scale --nproc 1,2 --steps 15 -- examples/nanogpt_style.py

Knobs are module-level globals overridable as --name=value, as nanoGPT's configurator does.
"""

import math
import os
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

# -----------------------------------------------------------------------------
batch_size = 8  # micro-batch size per forward
block_size = 64  # context length
n_layer, n_head, n_embd = 2, 4, 64
gradient_accumulation_steps = 4  # used to simulate larger batch sizes; divided by the world size
learning_rate = 1e-3
max_iters = 200
warmup_iters = 10
eval_interval = 50
eval_iters = 5
log_interval = 10
backend = "gloo"  # 'nccl' on GPUs
device = "cpu"
seed = 1337
for arg in sys.argv[1:]:  # --key=value overrides, as nanoGPT's configurator
    key, _, val = arg.removeprefix("--").partition("=")
    globals()[key] = type(globals()[key])(val)
# -----------------------------------------------------------------------------

ddp = int(os.environ.get("RANK", -1)) != -1  # is this a ddp run?
if ddp:
    init_process_group(backend=backend)
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    if device.startswith("cuda"):
        device = f"cuda:{ddp_local_rank}"
        torch.cuda.set_device(device)
    master_process = ddp_rank == 0  # this process will do logging, checkpointing etc.
    seed_offset = ddp_rank  # each process gets a different seed
    # world_size number of processes will be training simultaneously, so we can scale
    # down the desired gradient accumulation iterations per process proportionally
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    master_process, seed_offset, ddp_world_size = True, 0, 1
tokens_per_iter = gradient_accumulation_steps * ddp_world_size * batch_size * block_size
if master_process:
    print(f"tokens per iteration will be: {tokens_per_iter:,}")
torch.manual_seed(seed + seed_offset)

# data: a generated "corpus" of repeated words with some noise, as byte tokens
g = torch.Generator().manual_seed(0)
lengths = torch.randint(2, 8, (50,), generator=g).tolist()
words = [bytes(torch.randint(97, 123, (n,), generator=g).tolist()) for n in lengths]
text = b" ".join(words[i] for i in torch.randint(0, 50, (40_000,), generator=g).tolist())
data = torch.tensor(list(text), dtype=torch.long)
n = int(0.9 * len(data))
train_data, val_data = data[:n], data[n:]


def get_batch(split):
    d = train_data if split == "train" else val_data
    ix = torch.randint(len(d) - block_size, (batch_size,))
    x = torch.stack([d[i : i + block_size] for i in ix])
    y = torch.stack([d[i + 1 : i + 1 + block_size] for i in ix])
    return x.to(device), y.to(device)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = nn.MultiheadAttention(n_embd, n_head, batch_first=True)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.register_buffer("mask", torch.triu(torch.ones(block_size, block_size, dtype=torch.bool), 1))

    def forward(self, x):
        t = x.size(1)
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask[:t, :t], need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(256, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList([Block() for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, 256, bias=False)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, 256), targets.view(-1))
        return logits, loss


torch.manual_seed(seed)  # the same initial weights everywhere
model = GPT().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
if ddp:
    model = DDP(model, device_ids=[ddp_local_rank] if device.startswith("cuda") else None)
raw_model = model.module if ddp else model
ctx = nullcontext()


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                _, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    return learning_rate * 0.5 * (1 + math.cos(math.pi * min(1.0, (it - warmup_iters) / max_iters)))


X, Y = get_batch("train")  # fetch the very first batch
t0 = time.time()
for iter_num in range(max_iters + 1):
    for param_group in optimizer.param_groups:
        param_group["lr"] = get_lr(iter_num)
    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            # only sync gradients at the last micro step, as nanoGPT does (instead of no_sync())
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps  # scale the loss to account for accumulation
        X, Y = get_batch("train")  # async prefetch the next batch while the model works
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if iter_num % log_interval == 0 and master_process:
        lossf = loss.item() * gradient_accumulation_steps
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms")

if ddp:
    destroy_process_group()
