"""Numerical equivalence, the test of record: data parallelism equals the computation it replaces.

Tolerances: fp32 gradients of a sum over a batch split in W parts and averaged differ from the
single-process gradient only by the order of floating-point additions; 1e-6 relative (with a
1e-7 absolute floor for entries near zero) is a few ulps for these sizes. Parameters after 10
SGD steps against torch DDP: both average the same fp32 buckets, so they agree to 1e-6.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dpscale import DistributedDataParallel
from dpscale.lab.multirank import run_ranks
from support.echo_group import EchoGroup

pytestmark = pytest.mark.compat  # also run on a second torch release (make test-compat)

RTOL, ATOL = 1e-6, 1e-7


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5))


def make_data(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g)


def grads_one_step(rank, world, per_rank, bucket_cap_mb):
    model = DistributedDataParallel(
        make_model(), bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=bucket_cap_mb
    )
    x, y = make_data(per_rank * world)
    shard = slice(rank * per_rank, (rank + 1) * per_rank)
    nn.functional.cross_entropy(model(x[shard]), y[shard]).backward()
    assert model.last_step_stats is not None
    return {n: p.grad.clone() for n, p in model.module.named_parameters()}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow
def test_gradients_equal_single_process_on_concatenated_batch(world):
    per_rank = 6
    # tiny buckets so that several reductions are in flight at once
    results = run_ranks(grads_one_step, world, per_rank, 0.001)
    ref = make_model()
    x, y = make_data(per_rank * world)
    nn.functional.cross_entropy(ref(x), y).backward()
    for rank_grads in results:
        for n, p in ref.named_parameters():
            torch.testing.assert_close(rank_grads[n], p.grad, rtol=RTOL, atol=ATOL, msg=n)


def train_10_steps(rank, world, engine):
    model = make_model(seed=rank)  # different init on purpose: construction must broadcast rank 0's
    if engine == "torch":
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.002)
    else:
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.002)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    x, y = make_data(8 * world * 10, seed=3)
    for step in range(10):
        lo = (step * world + rank) * 8
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x[lo : lo + 8]), y[lo : lo + 8]).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in ddp.module.named_parameters()}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow
def test_parameters_after_10_sgd_momentum_steps_equal_torch_ddp(world):
    ours = run_ranks(train_10_steps, world, "dpscale")
    theirs = run_ranks(train_10_steps, world, "torch")
    for n in ours[0]:
        for r in range(world):
            torch.testing.assert_close(ours[r][n], ours[0][n], rtol=0, atol=0, msg=f"replicas differ: {n}")
        torch.testing.assert_close(ours[0][n], theirs[0][n], rtol=1e-6, atol=1e-7, msg=n)


def accumulate(rank, world, k, mode):
    model = DistributedDataParallel(make_model())
    per_micro = 4
    x, y = make_data(per_micro * k * world, seed=5)
    mine = torch.arange(rank * per_micro * k, (rank + 1) * per_micro * k)
    chunks = mine.split(per_micro)
    for j, idx in enumerate(chunks):
        last = j == k - 1

        # each micro-batch loss is a mean over 4 samples; divide by k so the sum is the k*4 mean
        def step(idx=idx):
            (nn.functional.cross_entropy(model(x[idx]), y[idx]) / k).backward()

        if last:
            step()
        elif mode == "no_sync":
            with model.no_sync():
                step()
        else:
            model.require_backward_grad_sync = False
            step()
            model.require_backward_grad_sync = True
    return {n: p.grad.clone() for n, p in model.module.named_parameters()}


@pytest.mark.parametrize("mode", ["no_sync", "toggle"])
@pytest.mark.slow
def test_accumulation_equals_k_times_larger_batch(mode):
    world, k = 2, 3
    results = run_ranks(accumulate, world, k, mode)
    ref = make_model()
    x, y = make_data(4 * k * world, seed=5)
    nn.functional.cross_entropy(ref(x), y).backward()
    for rank_grads in results:
        for n, p in ref.named_parameters():
            torch.testing.assert_close(rank_grads[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)


def no_sync_restores_on_error(rank, world):
    model = DistributedDataParallel(make_model())
    try:
        with model.no_sync():
            raise KeyError("inside")
    except KeyError:
        pass
    return model.require_backward_grad_sync


@pytest.mark.slow
def test_no_sync_restores_state_when_body_raises():
    assert run_ranks(no_sync_restores_on_error, 1) == [True]


def grads_after_zero_grad_without_none(rank, world):
    """zero_grad(set_to_none=False) keeps .grad as the bucket view: autograd adds in place."""
    model = DistributedDataParallel(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x, y = make_data(8 * world, seed=9)
    out = []
    for _ in range(2):
        opt.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(model(x[rank * 8 : rank * 8 + 8]), y[rank * 8 : rank * 8 + 8]).backward()
        out.append({n: p.grad.clone() for n, p in model.module.named_parameters()})
    return out


@pytest.mark.slow
def test_in_place_zeroed_grads_give_same_result_each_step():
    res = run_ranks(grads_after_zero_grad_without_none, 2)
    ref = make_model()
    x, y = make_data(16, seed=9)
    nn.functional.cross_entropy(ref(x), y).backward()
    for per_step in res:
        for grads in per_step:
            for n, p in ref.named_parameters():
                torch.testing.assert_close(grads[n], p.grad, rtol=RTOL, atol=ATOL, msg=n)


def state_dict_keys(rank, world):
    model = make_model()
    ours = DistributedDataParallel(model).state_dict().keys()
    theirs = nn.parallel.DistributedDataParallel(model).state_dict().keys()
    return list(ours), list(theirs)


@pytest.mark.slow
def test_state_dict_keys_match_torch_ddp():
    ((ours, theirs),) = run_ranks(state_dict_keys, 1)
    assert ours == theirs
    assert all(k.startswith("module.") for k in ours)


def test_unknown_keyword_is_type_error():
    with pytest.raises(TypeError):
        DistributedDataParallel(make_model(), bucket_cap=3)


def world_is_initialized(rank, world):
    return dist.is_initialized()


@pytest.mark.slow
def test_harness_gives_a_process_group():
    assert run_ranks(world_is_initialized, 2) == [True, True]


class TwoHeads(nn.Module):
    """`a` and `b` share a bucket; `use_b` decides whether `b` takes part."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.ones(3))
        self.b = nn.Parameter(torch.ones(3))

    def forward(self, x, use_b):
        return (self.a * x).sum() + ((self.b * x).sum() if use_b else 0.0)


def mixed_bucket(rank, world, transport):
    # micro-batch 1 (no_sync) uses only `a`, so at the synced backward `a` was accumulated in its
    # view while `b` arrives fresh: one bucket, gradients in both states
    model = DistributedDataParallel(TwoHeads(), transport=transport, find_unused_parameters=True)
    x = torch.full((3,), float(rank + 1))
    with model.no_sync():
        model(x, use_b=False).backward()
    model(x, use_b=True).backward()
    return model.module.a.grad.clone(), model.module.b.grad.clone()


@pytest.mark.parametrize("transport", ["gloo", "shm"])
@pytest.mark.slow
def test_bucket_mixing_accumulated_and_fresh_gradients_is_averaged_once(transport):
    (a0, b0), (a1, b1) = run_ranks(mixed_bucket, 2, transport)
    # a: 2 micro-batches of x = r + 1 on rank r -> 2, 4; mean 3.  b: one of x -> 1, 2; mean 1.5
    for a, b in ((a0, b0), (a1, b1)):
        torch.testing.assert_close(a, torch.full((3,), 3.0))
        torch.testing.assert_close(b, torch.full((3,), 1.5))


@pytest.mark.parametrize("no_sync", [False, True])
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("gradient_as_bucket_view", [False, True])
@pytest.mark.parametrize("width", [4, 256])  # buckets of small tensors, of large ones
def test_pre_division_is_torch_ddps_bit_for_bit(width, gradient_as_bucket_view, set_to_none, no_sync):
    # x / 3 and x * (1/3) differ in the last bit for about a third of all x. torch's reducer
    # multiplies a fresh gradient by 1/3 as it copies it into the bucket and divides one that is
    # its bucket view already (gradient_as_bucket_view, .grad zeroed in place): so does dpscale.
    # A no_sync step first: torch leaves .grad alone there (a tensor of its own until the sync)
    grads = {}
    for engine in (nn.parallel.DistributedDataParallel, DistributedDataParallel):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
        # find_unused_parameters: torch then never rebuilds its buckets (a collective this group lacks)
        ddp = engine(
            model,
            process_group=EchoGroup(world_size=3),
            init_sync=False,
            gradient_as_bucket_view=gradient_as_bucket_view,
            find_unused_parameters=engine is nn.parallel.DistributedDataParallel,
        )
        x = torch.randn(8, width, generator=torch.Generator().manual_seed(1))
        for step in range(3):  # later steps reuse the buckets (and dpscale's pool)
            ddp.zero_grad(set_to_none=set_to_none or step == 0)
            if no_sync:
                with ddp.no_sync():
                    ddp(x.flip(0)).square().sum().backward()
            ddp(x).square().sum().backward()
        grads[engine] = [p.grad.clone() for p in model.parameters()]
    ours, theirs = grads[DistributedDataParallel], grads[nn.parallel.DistributedDataParallel]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


class UsedInNoSyncOnly(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x, use_b):
        return self.b(self.a(x)) if use_b else self.a(x)


def _grads_after(width: int, steps) -> dict:
    """Both engines' gradients after `steps`, a list of (no_sync, use_b, set_to_none)."""
    grads = {}
    for engine in (nn.parallel.DistributedDataParallel, DistributedDataParallel):
        torch.manual_seed(0)
        model = UsedInNoSyncOnly(width)
        ddp = engine(
            model,
            process_group=EchoGroup(world_size=3),
            init_sync=False,
            gradient_as_bucket_view=True,
            find_unused_parameters=True,
        )
        g = torch.Generator().manual_seed(1)
        for no_sync, use_b, set_to_none in steps:
            if set_to_none is not None:
                ddp.zero_grad(set_to_none=set_to_none)
            x = torch.randn(8, width, generator=g)
            if no_sync:
                with ddp.no_sync():
                    ddp(x, use_b=use_b).square().sum().backward()
            else:
                ddp(x, use_b=use_b).square().sum().backward()
        grads[engine] = [p.grad.clone() for p in model.parameters()]
    return grads


@pytest.mark.parametrize(
    "steps",
    [
        # `b` gets its gradient in the no_sync step only: reduced when finalize finds it unused,
        # from a bucket view that torch's .grad is not (a tensor of its own: multiplied by 1/3)
        [(True, True, None), (False, False, None)],
        # zero_grad(set_to_none=False) keeps a's gradients as their bucket views while b, unused
        # everywhere in the first step, is None again: one bucket of small tensors, a's divided
        # in place and b's multiplied, as torch does tensor by tensor
        [(False, False, False), (False, True, False)],
    ],
    ids=["no-sync-gradient-unused-at-the-sync", "kept-views-and-a-fresh-gradient-in-one-bucket"],
)
@pytest.mark.parametrize("width", [4, 256])
def test_pre_division_of_gradients_of_different_histories_is_torch_ddps(width, steps):
    grads = _grads_after(width, steps)
    ours, theirs = grads[DistributedDataParallel], grads[nn.parallel.DistributedDataParallel]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


class TiedGPT(nn.Module):
    """nanoGPT's shape at toy size: token and position embeddings, one pre-norm attention + MLP
    block, the output head tied to the token embedding (one parameter used at both ends)."""

    def __init__(self, vocab: int = 32, width: int = 16, block: int = 8):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.ln_1, self.ln_2, self.ln_f = nn.LayerNorm(width), nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.head = nn.Linear(width, vocab, bias=False)
        self.wte.weight = self.head.weight
        self.register_buffer("mask", torch.triu(torch.ones(block, block, dtype=torch.bool), 1))

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask, need_weights=False)[0]
        x = x + self.mlp(self.ln_2(x))
        logits = self.head(self.ln_f(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize(("gradient_as_bucket_view", "find_unused"), [(False, False), (True, True)])
@pytest.mark.parametrize("width", [16, 128])  # one bucket of small tensors, of large ones
def test_a_nanogpt_style_loop_is_torch_ddps_bit_for_bit(width, gradient_as_bucket_view, find_unused):
    # The loop people copy: accumulation with no_sync() or require_backward_grad_sync, grad
    # clipping, AdamW (which turns a last-bit difference in a gradient into a visible one),
    # zero_grad(set_to_none=True). On an EchoGroup each rank's contribution is compared; the
    # order of the sum over ranks is the transport's (at W >= 3 it depends on the bucket layout:
    # torch's own result changes with bucket_cap_mb there, see docs/torch-ddp-tests.md).
    params = {}
    for engine in (nn.parallel.DistributedDataParallel, DistributedDataParallel):
        torch.manual_seed(0)
        model = TiedGPT(width=width)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        ddp = engine(
            model,
            process_group=EchoGroup(world_size=3),
            init_sync=False,
            broadcast_buffers=False,  # a broadcast, which this group lacks
            gradient_as_bucket_view=gradient_as_bucket_view,
            # torch's bucket rebuild after step 1 is a broadcast too: find_unused never rebuilds
            find_unused_parameters=find_unused or engine is nn.parallel.DistributedDataParallel,
        )
        g = torch.Generator().manual_seed(1)
        for it in range(3):
            for micro in range(2):
                idx, targets = torch.randint(32, (2, 2, 8), generator=g)
                if it % 2:  # nanoGPT's toggle
                    ddp.require_backward_grad_sync = micro == 1
                    (ddp(idx, targets) / 2).backward()
                else:
                    with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                        (ddp(idx, targets) / 2).backward()
            nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        params[engine] = [p.detach().clone() for p in model.parameters()]
    ours, theirs = params[DistributedDataParallel], params[nn.parallel.DistributedDataParallel]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
