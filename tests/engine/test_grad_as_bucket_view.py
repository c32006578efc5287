"""gradient_as_bucket_view behaves as torch's: True, .grad is a view into its bucket; False (the
default), .grad is a tensor apart from the buckets, which the reduced values are copied into.

What a user can see is compared with torch's own DDP in the same ranks: whether a gradient kept
from one step is overwritten by the next step's reduction, whether `.grad` stays the same tensor
across steps under `zero_grad(set_to_none=False)`, and the values.
"""

import weakref

import pytest
import torch
from torch import nn

from dpscale import DistributedDataParallel
from dpscale.engine.reducer import SMALL_TENSOR_NUMEL
from dpscale.lab.multirank import run_ranks
from support.echo_group import EchoGroup


def model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "small":  # buckets of small tensors: autograd accumulates into the bucket itself
        return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 3))
    n = 128  # one tensor above SMALL_TENSOR_NUMEL: the gradient is copied into its bucket
    assert n * n > SMALL_TENSOR_NUMEL
    return nn.Sequential(nn.Linear(n, n, bias=False))


def observe(rank, world):
    torch.manual_seed(rank)
    out = {}
    for kind in ("small", "large"):
        width = 4 if kind == "small" else 128
        xs = [torch.randn(8, width) for _ in range(4)]
        for engine in ("torch", "dpscale"):
            cls = DistributedDataParallel if engine == "dpscale" else DistributedDataParallel.__mro__[1]
            for as_view in (False, True):
                ddp = cls(model(kind), gradient_as_bucket_view=as_view)
                params = list(ddp.parameters())
                # torch lays its buckets out again after the first step: observe from the second
                ddp(xs[3]).square().sum().backward()
                ddp.zero_grad(set_to_none=True)
                ddp(xs[0]).square().sum().backward()
                kept = [p.grad for p in params]
                values = [g.clone() for g in kept]
                ddp.zero_grad(set_to_none=True)
                ddp(xs[1]).square().sum().backward()
                overwritten = any(not torch.equal(g, v) for g, v in zip(kept, values, strict=True))
                # a view kept of a gradient (no reference to the tensor itself) survives too
                kept = [p.grad.view(-1) for p in params]
                values = [g.clone() for g in kept]
                ddp.zero_grad(set_to_none=True)
                ddp(xs[0]).square().sum().backward()
                view_overwritten = any(not torch.equal(g, v) for g, v in zip(kept, values, strict=True))
                del kept
                second = [p.grad for p in params]
                ddp.zero_grad(set_to_none=False)
                ddp(xs[2]).square().sum().backward()
                same_tensor = all(p.grad is g for p, g in zip(params, second, strict=True))
                out[kind, engine, as_view] = {
                    "overwritten": overwritten,
                    "view_overwritten": view_overwritten,
                    "same_tensor": same_tensor,
                    "values": [v for v in values] + [p.grad.clone() for p in params],
                }
    return out


@pytest.mark.slow
def test_what_a_user_sees_of_gradient_as_bucket_view_is_torchs():
    for seen in run_ranks(observe, 2):
        for kind in ("small", "large"):
            for as_view in (False, True):
                ours, theirs = seen[kind, "dpscale", as_view], seen[kind, "torch", as_view]
                # False: a gradient kept from a step survives the next; True: it is the bucket
                assert theirs["overwritten"] is as_view, (kind, as_view)
                assert ours["overwritten"] is theirs["overwritten"], (kind, as_view)
                assert theirs["view_overwritten"] is as_view, (kind, as_view)
                assert ours["view_overwritten"] is theirs["view_overwritten"], (kind, as_view)
                assert ours["same_tensor"] and theirs["same_tensor"], (kind, as_view)
                for a, b in zip(ours["values"], theirs["values"], strict=True):
                    torch.testing.assert_close(a, b)


class SmallPair(nn.Module):
    """`a` and `b` (small tensors) share a bucket; `use_ab` decides whether they take part."""

    def __init__(self):
        super().__init__()
        self.big = nn.Linear(8, 8)
        self.a = nn.Parameter(torch.ones(3))
        self.b = nn.Parameter(torch.ones(3))

    def forward(self, x, use_ab):
        out = self.big(x).sum()
        return out + (self.a * x[:, :3]).sum() + self.b.sum() if use_ab else out


def test_a_pool_gradient_set_to_none_after_forward_contributes_zeros():
    # The pool keeps last step's reduced values in its views; a .grad the user sets to None
    # between forward and backward (zero_grad after forward) must add zeros to the bucket, not those
    model = SmallPair()
    ddp = DistributedDataParallel(
        model, process_group=EchoGroup(), init_sync=False, bucket_cap_mb=1e-4, find_unused_parameters=True
    )
    pair = ddp.bucket_assignment.index(["b", "a"])  # a bucket of its own
    seen = {}

    def record(state, bucket):
        seen[bucket.index()] = bucket.buffer().clone()
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp.register_comm_hook(None, record)
    x = torch.randn(2, 8)
    ddp(x, use_ab=True).backward()
    assert seen[pair].abs().min() > 0  # the pool now holds a and b's (reduced) gradients
    out = ddp(x, use_ab=False)
    ddp.zero_grad(set_to_none=True)
    out.backward()
    assert torch.equal(seen[pair], torch.zeros(6))
    assert model.a.grad is None and model.b.grad is None


def test_a_fresh_gradient_is_freed_once_copied_into_its_bucket_view():
    # zero_grad(set_to_none=True), then backward: autograd makes a gradient of its own for each
    # large tensor, copied into the bucket and freed at once, as torch's reducer does (kept, they
    # would sit beside the buckets at the peak, and backward's next gradients would miss the cache)
    model = nn.Linear(128, 128, bias=False)
    fresh = []
    model.weight.register_post_accumulate_grad_hook(lambda p: fresh.append(weakref.ref(p.grad)))
    ddp = DistributedDataParallel(
        model, process_group=EchoGroup(), init_sync=False, gradient_as_bucket_view=True
    )
    for _ in range(2):
        ddp.zero_grad(set_to_none=True)
        ddp(torch.randn(4, 128)).sum().backward()
    view = model.weight.grad
    assert view.data_ptr() == ddp.reducer.buckets[0].buffer.data_ptr()  # .grad is the bucket view
    assert fresh[-1]() is None and fresh[0]() is None
