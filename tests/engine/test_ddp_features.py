"""Engine behaviours beyond plain averaging: unused parameters, model checks, hooks, buffers, stats."""

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dpscale import DistributedDataParallel
from dpscale.engine import bf16_compress_hook, fp16_compress_hook
from dpscale.lab.multirank import MultiRankError, run_ranks


class Branchy(nn.Module):
    """`extra` is used only when asked: the classic unused-parameter trap."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 4)
        self.extra = nn.Linear(4, 4)

    def forward(self, x, use_extra):
        h = self.body(x)
        return self.extra(h) if use_extra else h


def unused_allowed(rank, world):
    model = DistributedDataParallel(Branchy(), find_unused_parameters=True)
    x = torch.ones(2, 4) * (rank + 1)
    # rank 0 uses `extra`, rank 1 does not: its gradient is reduced as zeros from rank 1
    model(x, use_extra=(rank == 0)).sum().backward()
    first = {n: (None if p.grad is None else p.grad.clone()) for n, p in model.module.named_parameters()}
    model.zero_grad(set_to_none=True)
    model(x, use_extra=False).sum().backward()  # unused everywhere: .grad stays None
    second = {n: (None if p.grad is None else p.grad.clone()) for n, p in model.module.named_parameters()}
    return first, second


@pytest.mark.slow
def test_unused_parameters_reduced_as_zeros_when_allowed():
    (f0, s0), (f1, s1) = run_ranks(unused_allowed, 2)
    ref = Branchy()
    ref(torch.ones(2, 4), True).sum().backward()
    expected = ref.extra.weight.grad / 2  # rank 1 contributes zeros
    torch.testing.assert_close(f0["extra.weight"], expected)
    torch.testing.assert_close(f1["extra.weight"], expected)
    assert s0["extra.weight"] is None and s1["extra.weight"] is None
    assert s0["body.weight"] is not None


def unused_forbidden(rank, world):
    model = DistributedDataParallel(Branchy())
    model(torch.ones(2, 4), use_extra=False).sum().backward()


@pytest.mark.slow
def test_unused_parameter_without_flag_raises_naming_it():
    with pytest.raises(MultiRankError) as err:
        run_ranks(unused_forbidden, 2, timeout_s=60)
    assert "extra.weight" in str(err.value) and "find_unused_parameters=True" in str(err.value)


def mismatched(rank, world):
    torch.manual_seed(0)
    width = 8 if rank == 0 else 9
    DistributedDataParallel(nn.Sequential(nn.Linear(4, width), nn.Linear(width, 2)))


@pytest.mark.slow
def test_shape_mismatch_names_parameter_and_ranks():
    with pytest.raises(MultiRankError) as err:
        run_ranks(mismatched, 2, timeout_s=60)
    msg = str(err.value)
    assert "'0.weight'" in msg and "ranks 0 and 1" in msg and "[8, 4]" in msg and "[9, 4]" in msg


def hooked_grads(rank, world, hook_name):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4)))
    hooks = {
        "fp16": fp16_compress_hook,
        "bf16": bf16_compress_hook,
        "torch_fp16": default_hooks.fp16_compress_hook,
    }
    if hook_name:
        model.register_comm_hook(None, hooks[hook_name])
    g = torch.Generator().manual_seed(rank)
    model(torch.randn(8, 16, generator=g)).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.module.named_parameters()}


# fp16 keeps 11 significant bits (relative step 2**-11 ~ 4.9e-4), bf16 keeps 8 (2**-8 ~ 3.9e-3);
# a cast of each input and of the sum rounds at most ~2 ulps, and the atol covers near-zero entries.
@pytest.mark.parametrize(
    "hook,rtol,atol", [("fp16", 2e-3, 1e-5), ("bf16", 1.6e-2, 1e-4), ("torch_fp16", 2e-3, 1e-5)]
)
@pytest.mark.slow
def test_compression_hooks_within_documented_tolerance(hook, rtol, atol):
    exact = run_ranks(hooked_grads, 2, None)
    compressed = run_ranks(hooked_grads, 2, hook)
    for n in exact[0]:
        torch.testing.assert_close(compressed[0][n], exact[0][n], rtol=rtol, atol=atol, msg=n)
        torch.testing.assert_close(compressed[1][n], compressed[0][n], rtol=0, atol=0)


def batchnorm_buffers(rank, world):
    torch.manual_seed(rank)  # different buffers before construction
    model = nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), nn.Linear(6, 1))
    model[1].running_mean.fill_(float(rank))
    ddp = DistributedDataParallel(model)
    after_init = ddp.module[1].running_mean.clone()
    x = torch.randn(5, 3) + rank * 10  # each rank updates its own running statistics
    for _ in range(3):
        ddp(x).sum().backward()
    return after_init, ddp.module[1].running_mean.clone(), ddp.module[1].num_batches_tracked.clone()


@pytest.mark.slow
def test_buffers_are_broadcast_from_rank_0():
    (init0, mean0, n0), (init1, mean1, n1) = run_ranks(batchnorm_buffers, 2)
    assert init0.eq(0).all() and init1.eq(0).all()
    # the forward broadcasts rank 0's buffers first, so after step s the replicas differ only by
    # their last local update; rank 0's statistics are the ones every rank starts each step from
    assert n0.item() == n1.item() == 3
    assert not torch.equal(mean0, mean1)


def batchnorm_buffers_synced_before_forward(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), nn.Linear(6, 1))
    ddp = DistributedDataParallel(model)
    ddp(torch.randn(5, 3) + rank).sum().backward()
    seen = []
    hook = ddp.module[1].register_forward_pre_hook(lambda m, i: seen.append(m.running_mean.clone()))
    ddp(torch.randn(5, 3)).sum().backward()
    hook.remove()
    return seen[0]


@pytest.mark.slow
def test_every_rank_enters_forward_with_rank0_buffers():
    a, b = run_ranks(batchnorm_buffers_synced_before_forward, 2)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def stats_step(rank, world):
    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), bucket_cap_mb=0.01, first_bucket_cap_mb=0.01
    )
    model(torch.randn(4, 64)).sum().backward()
    s = model.last_step_stats
    return s.to_dict(), s.comm_bytes, sum(p.numel() * 4 for p in model.parameters())


@pytest.mark.slow
def test_step_stats_cover_every_bucket():
    (stats, comm_bytes, param_bytes), _ = run_ranks(stats_step, 2)
    assert comm_bytes == param_bytes
    assert len(stats["buckets"]) >= 2
    for b in stats["buckets"]:
        assert 0 <= b["start_ms"] <= b["end_ms"]
    assert stats["backward_ms"] > 0 and stats["comm_ms"] > 0 and stats["exposed_comm_ms"] >= 0


def test_exposed_communication_ends_when_the_last_reduction_does(monkeypatch):
    # what runs after the wait (copying reduced values into .grad, the noise scale's norms) is not
    # communication: counted in, it made one worker's mlp show 4 ms exposed of 0.5 ms reduced
    from dpscale.engine.reducer import Reducer

    copy_out, norms = Reducer._copy_out, Reducer._grad_norms
    slow = 0.05

    def slow_copy_out(self):
        time.sleep(slow)
        copy_out(self)

    def slow_norms(self):
        time.sleep(slow)
        return norms(self)

    monkeypatch.setattr(Reducer, "_copy_out", slow_copy_out)
    monkeypatch.setattr(Reducer, "_grad_norms", slow_norms)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = DistributedDataParallel(nn.Linear(64, 64))  # gradient_as_bucket_view=False: copies out
        model(torch.randn(4, 64)).sum().backward()
        s = model.last_step_stats
        model.close()
    finally:
        dist.destroy_process_group()
    assert s.exposed_comm_ms < slow * 1e3 and s.exposed_comm_ms <= s.comm_ms + 1.0, s


def test_construction_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="init_process_group"):
        DistributedDataParallel(nn.Linear(2, 2))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_stream_path_world_1(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).cuda()
        ref = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).cuda()
        ref.load_state_dict(model.state_dict())
        ddp = DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=0.001, first_bucket_cap_mb=0.001)
        x = torch.randn(16, 32, device="cuda")
        ddp(x).square().sum().backward()
        ref(x).square().sum().backward()
        torch.cuda.synchronize()
        for p, q in zip(ddp.module.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
    finally:
        dist.destroy_process_group()


def torch_ddp_with_our_hooks(rank, world):
    torch.manual_seed(0)
    out = []
    for hook in (fp16_compress_hook, bf16_compress_hook):
        model = nn.parallel.DistributedDataParallel(nn.Linear(8, 4))
        model.register_comm_hook(None, hook)  # torch checks hook signatures; ours must pass
        model(torch.ones(2, 8) * (rank + 1)).sum().backward()
        out.append(model.module.weight.grad.clone())
    return out


@pytest.mark.slow
def test_builtin_hooks_register_on_torch_ddp_too():
    (a16, ab16), (b16, bb16) = run_ranks(torch_ddp_with_our_hooks, 2)
    torch.testing.assert_close(a16, b16, rtol=0, atol=0)
    # two samples of x = rank + 1 on each rank: local gradients 2 and 4, their mean 3
    torch.testing.assert_close(a16[0], torch.full((8,), 3.0))
    torch.testing.assert_close(ab16[0], torch.full((8,), 3.0))
