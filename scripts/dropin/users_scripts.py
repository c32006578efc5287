"""Users' scripts on torch's DistributedDataParallel and on dpscale's, in the same ranks.

    torchrun --standalone --nproc-per-node 2 scripts/dropin/users_scripts.py   # or 3

Two scripts in the style people write: PyTorch's DDP tutorial (ToyModel, demo_basic: SGD, MSE),
and nanoGPT's loop (tied embedding and head, attention, accumulation with `no_sync()` or
`require_backward_grad_sync`, grad clipping, AdamW, `zero_grad(set_to_none=True)`). Each
configuration (gradient_as_bucket_view, find_unused_parameters, ...) runs on torch's class, then
on dpscale's with transport auto (shm here) and gloo, from the same RNG state; rank 0 prints
whether every parameter equals torch's bit for bit.

At three ranks or more the order of the additions in the all-reduce depends on the bucket layout
(gloo's ring sums each chunk of a bucket starting at another rank), so torch's own result changes
with `bucket_cap_mb`: the script then also runs torch against itself with another cap, and checks
that after one synced backward both engines' gradients are, element by element, sums of the same
per-rank contributions (each multiplied by 1/W as torch does) in some order. See
docs/torch-ddp-tests.md.
"""

import functools
import itertools
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import dpscale

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


class ToyModel(nn.Module):
    """The tutorial's model; `net3`, if asked for, is used on some ranks at some steps only."""

    def __init__(self, unused_branch=False):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)
        self.net3 = nn.Linear(10, 5) if unused_branch else None
        self.step = 0

    def forward(self, x):
        h = self.relu(self.net1(x))
        out = self.net2(h)
        if self.net3 is not None and (self.step + rank) % 3 == 0:
            out = out + self.net3(h)
        self.step += 1
        return out


def demo_basic(engine, as_view, unused, set_to_none, steps=10):
    torch.manual_seed(1234 + rank)  # a different init on each rank: DDP broadcasts rank 0's
    model = ToyModel(unused_branch=unused)
    ddp_model = engine(model, gradient_as_bucket_view=as_view, find_unused_parameters=unused)
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.001)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=set_to_none)
        outputs = ddp_model(torch.randn(20, 10))
        loss_fn(outputs, torch.randn(20, 5)).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


N_EMBD, N_HEAD, BLOCK, VOCAB = 32, 4, 16, 64


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(N_EMBD), nn.LayerNorm(N_EMBD)
        self.attn = nn.MultiheadAttention(N_EMBD, N_HEAD, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(N_EMBD, 4 * N_EMBD), nn.GELU(), nn.Linear(4 * N_EMBD, N_EMBD))
        self.register_buffer("mask", torch.triu(torch.ones(BLOCK, BLOCK, dtype=torch.bool), 1))

    def forward(self, x):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, N_EMBD), nn.Embedding(BLOCK, N_EMBD)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.ln_f = nn.LayerNorm(N_EMBD)
        self.lm_head = nn.Linear(N_EMBD, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def batch(g):
    return torch.randint(VOCAB, (4, BLOCK), generator=g), torch.randint(VOCAB, (4, BLOCK), generator=g)


def nanogpt(engine, as_view, unused, mode, iters=5, accum=2):
    torch.manual_seed(1337)
    model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    model = engine(model, gradient_as_bucket_view=as_view, find_unused_parameters=unused)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(iters):
        for micro in range(accum):
            last = micro == accum - 1
            x, y = batch(g)
            if mode == "require_backward_grad_sync":  # nanoGPT's toggle
                model.require_backward_grad_sync = last
                ctx = torch.enable_grad()
            else:
                ctx = torch.enable_grad() if last else model.no_sync()
            with ctx:
                _, loss = model(x, y)
                (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.module.parameters()]


ENGINES = {
    "dpscale (auto)": dpscale.DistributedDataParallel,
    "dpscale (gloo)": functools.partial(dpscale.DistributedDataParallel, transport="gloo"),
}
if world >= 3:
    ENGINES["torch, bucket_cap_mb=0.01"] = functools.partial(TorchDDP, bucket_cap_mb=0.01)


def compare(name, run, **config) -> dict[str, bool]:
    """Run `run` on torch's class and on each of ENGINES: which of them differ from torch's."""
    ref = run(TorchDDP, **config)
    verdicts = {}
    for label, engine in ENGINES.items():
        got = run(engine, **config)
        diffs = [(a - b).abs().max().item() for a, b in zip(ref, got, strict=True)]
        n = sum(d > 0 for d in diffs)
        verdicts[label] = "equal" if n == 0 else f"{n}/{len(diffs)} differ (max {max(diffs):.1e})"
    if rank == 0:
        shown = "; ".join(f"{k}: {v}" for k, v in verdicts.items())
        print(f"W={world} {name} {config}: {shown}", flush=True)
    return {k: v != "equal" for k, v in verdicts.items()}


def sums_of_the_same_contributions() -> bool:
    """After one synced backward of the GPT: is each engine's gradient, element by element, one of
    the W! orders of summing the ranks' local gradients multiplied by 1/W?"""
    torch.manual_seed(1337)
    local = GPT()
    x, y = batch(torch.Generator().manual_seed(100 + rank))
    local(x, y)[1].backward()
    contributions = [None] * world
    dist.all_gather_object(contributions, [p.grad * (1.0 / world) for p in local.parameters()])
    ok = True
    for engine in (TorchDDP, *ENGINES.values()):
        torch.manual_seed(1337)
        model = engine(GPT())
        model(x, y)[1].backward()
        for k, p in enumerate(model.module.parameters()):
            parts = [c[k] for c in contributions]
            orders = itertools.permutations(range(world))
            sums = [functools.reduce(torch.add, (parts[r] for r in order)) for order in orders]
            ok &= bool(torch.stack([p.grad == s for s in sums]).any(0).all())
    if rank == 0:
        print(f"W={world} one synced backward: every engine sums the same contributions: {ok}")
    return ok


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    only = sys.argv[1] if len(sys.argv) > 1 else "all"
    differs = dict.fromkeys(ENGINES, 0)
    for as_view, unused in itertools.product([False, True], [False, True]):
        if only in ("all", "tutorial"):
            for set_to_none in (True, False):
                config = dict(as_view=as_view, unused=unused, set_to_none=set_to_none)
                for k, v in compare("tutorial", demo_basic, **config).items():
                    differs[k] += v
        if only in ("all", "nanogpt"):
            for mode in ("no_sync", "require_backward_grad_sync"):
                config = dict(as_view=as_view, unused=unused, mode=mode)
                for k, v in compare("nanogpt", nanogpt, **config).items():
                    differs[k] += v
    same_sums = sums_of_the_same_contributions() if world >= 3 else True
    if rank == 0:
        print(f"W={world}: configurations that differ from torch's default: {differs}")
    dist.destroy_process_group()
    # at W=2 the sum of two contributions has one order: any difference is dpscale's
    return 0 if same_sums and (world >= 3 or not any(differs.values())) else 1


if __name__ == "__main__":
    sys.exit(main())
