"""ShardedOptimizer (ZeRO stage 1): the same parameters as plain data parallelism, 1/W of the state
per rank, and checkpoints that resume at another world size.

Tolerance: 1e-6 absolute on parameters of order 0.1-1 after a few steps. Both sides average the same
fp32 gradients (DDP: pre-divided all-reduce; sharded: reduce-scatter of the sums, then divided), so
they differ only in the order of additions, a few ulps (~1e-7) per step; SGD, Adam and AdamW act
element-wise and at these learning rates pass such differences on without amplifying them. A wrong
shard boundary, a stale hyperparameter or a lost state entry moves parameters by 1e-3 or more.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dpscale import DistributedDataParallel
from dpscale.lab.multirank import run_ranks
from dpscale.optim import ShardedOptimizer, local_gradients_hook, state_bytes
from dpscale.train.checkpoint.files import load_checkpoint, save_checkpoint, step_dir_name

ATOL = 1e-6
GLOBAL_BATCH = 12  # splits evenly at world sizes 1, 2 and 3
OPTIMIZERS = {
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5))


def param_groups(model: nn.Module, name: str):
    if name != "adamw":
        return model.parameters()
    # two groups, the usual AdamW split: shards then cut across a group boundary
    weights = [p for p in model.parameters() if p.dim() > 1]
    biases = [p for p in model.parameters() if p.dim() == 1]
    return [{"params": weights}, {"params": biases, "weight_decay": 0.0}]


def batch(step: int, rank: int, world: int):
    """This rank's equal part of global batch `step`: the mean over ranks is the full-batch mean."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(GLOBAL_BATCH, 12, generator=g), torch.randint(0, 5, (GLOBAL_BATCH,), generator=g)
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def train(model, opt, steps, rank, world, start=0):
    for step in range(start, start + steps):
        x, y = batch(step, rank, world)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# ---- equivalence with dpscale.DistributedDataParallel + the same optimizer -----------------------


def sharded_vs_ddp(rank, world, steps):
    out = {}
    for name, (cls, kwargs) in OPTIMIZERS.items():
        ddp = DistributedDataParallel(make_model())
        plain = cls(param_groups(ddp.module, name), **kwargs)
        model = make_model()
        sharded = ShardedOptimizer(cls, param_groups(model, name), **kwargs)
        train(ddp, plain, steps, rank, world)
        train(model, sharded, steps, rank, world)
        out[name] = {
            "ddp": flat_params(ddp.module),
            "sharded": flat_params(model),
            "state_bytes": state_bytes(sharded),
            "unsharded_state_bytes": state_bytes(plain),
        }
    # a model that stays wrapped in DDP: the no-op hook leaves the reduction to the optimizer
    wrapped = DistributedDataParallel(make_model())
    wrapped.register_comm_hook(None, local_gradients_hook)
    cls, kwargs = OPTIMIZERS["adam"]
    train(wrapped, ShardedOptimizer(cls, wrapped.parameters(), **kwargs), steps, rank, world)
    out["adam_in_ddp"] = {"ddp": out["adam"]["ddp"], "sharded": flat_params(wrapped.module)}
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow
def test_parameters_equal_ddp_and_each_rank_holds_1_over_w_of_the_state(world):
    results = run_ranks(sharded_vs_ddp, world, 5)
    for name in [*OPTIMIZERS, "adam_in_ddp"]:
        for r in range(world):
            # every rank holds the same parameters after the all-gather, bit for bit
            assert torch.equal(results[r][name]["sharded"], results[0][name]["sharded"]), (name, r)
        diff = (results[0][name]["sharded"] - results[0][name]["ddp"]).abs().max()
        assert diff <= ATOL, f"{name}: max |sharded - ddp| = {diff:.3g}"
    for name in OPTIMIZERS:
        unsharded = results[0][name]["unsharded_state_bytes"]
        for r in range(world):
            # within 5% of 1/W: padding to a multiple of W and a scalar per segment (Adam's step)
            ratio = results[r][name]["state_bytes"] / unsharded
            assert abs(ratio * world - 1) <= 0.05, f"{name} rank {r}: {ratio:.4f} of the state, not 1/{world}"


# ---- checkpoints: saved at W=2, resumed at W=3 and W=1 -------------------------------------------

SAVED_AT, MORE = 3, 3


def train_and_save(rank, world, root):
    model = make_model()
    cls, kwargs = OPTIMIZERS["adamw"]
    opt = ShardedOptimizer(cls, param_groups(model, "adamw"), **kwargs)
    train(model, opt, SAVED_AT, rank, world)
    state = opt.state_dict()  # collective: every rank takes part
    if rank == 0:
        save_checkpoint(root, SAVED_AT, {"model": model.state_dict(), "optimizer": state})


def load_and_train(rank, world, root):
    payload = load_checkpoint(f"{root}/{step_dir_name(SAVED_AT)}").payload
    model = make_model()
    model.load_state_dict(payload["model"])
    cls, kwargs = OPTIMIZERS["adamw"]
    opt = ShardedOptimizer(cls, param_groups(model, "adamw"), **kwargs)
    opt.load_state_dict(payload["optimizer"])
    train(model, opt, MORE, rank, world, start=SAVED_AT)
    return flat_params(model)


@pytest.mark.slow
def test_checkpoint_saved_at_two_ranks_resumes_at_three_and_one_like_an_unsharded_run(tmp_path):
    run_ranks(train_and_save, 2, str(tmp_path))
    resumed = {w: run_ranks(load_and_train, w, str(tmp_path)) for w in (3, 1)}

    # the reference: one process, full batches, plain AdamW
    model = make_model()
    cls, kwargs = OPTIMIZERS["adamw"]
    plain = cls(param_groups(model, "adamw"), **kwargs)
    train(model, plain, SAVED_AT, 0, 1)
    saved = load_checkpoint(tmp_path / step_dir_name(SAVED_AT)).payload["optimizer"]
    # the consolidated state is torch's own format, entry for entry
    reference = plain.state_dict()
    assert saved["param_groups"] == reference["param_groups"]
    assert saved["state"].keys() == reference["state"].keys()
    for i, entry in reference["state"].items():
        assert saved["state"][i].keys() == entry.keys()
        for k, v in entry.items():
            torch.testing.assert_close(saved["state"][i][k], v, rtol=0, atol=ATOL, msg=f"{i} {k}")
    # so a plain optimizer resumes from it too
    interop_model = make_model()
    interop_model.load_state_dict(model.state_dict())
    interop = cls(param_groups(interop_model, "adamw"), **kwargs)
    interop.load_state_dict(saved)
    train(interop_model, interop, MORE, 0, 1, start=SAVED_AT)

    train(model, plain, MORE, 0, 1, start=SAVED_AT)
    expected = flat_params(model)
    assert (flat_params(interop_model) - expected).abs().max() <= ATOL
    for world, params in resumed.items():
        for r, p in enumerate(params):
            diff = (p - expected).abs().max()
            assert diff <= ATOL, f"resumed at W={world}, rank {r}: max |diff| = {diff:.3g}"


# ---- user errors ---------------------------------------------------------------------------------


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_mixed_dtypes_are_refused_with_the_fix():
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3, dtype=torch.float64))]
    with pytest.raises(ValueError, match="one dtype and device.*one ShardedOptimizer per kind"):
        ShardedOptimizer(torch.optim.SGD, params, lr=0.1)


def test_an_uninitialized_process_group_is_a_value_error():
    with pytest.raises(ValueError, match="init_process_group"):
        ShardedOptimizer(torch.optim.SGD, make_model().parameters(), lr=0.1)


def test_a_state_for_other_parameters_is_refused(one_rank_group):
    model = make_model()
    opt = ShardedOptimizer(torch.optim.Adam, model.parameters(), lr=1e-2)
    other = torch.optim.Adam(param_groups(make_model(), "adamw"), lr=1e-2)
    with pytest.raises(ValueError, match=r"groups of sizes \[3, 3\], this optimizer has \[6\]"):
        opt.load_state_dict(other.state_dict())


def test_frozen_parameters_are_neither_moved_nor_given_state(one_rank_group):
    model = make_model()
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    opt = ShardedOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-2, weight_decay=0.5)
    train(model, opt, 2, 0, 1)
    assert torch.equal(model[0].weight, frozen)
    state = opt.state_dict()["state"]
    assert 0 not in state and sorted(state) == [1, 2, 3, 4, 5]


def test_a_scheduler_drives_the_wrapped_optimizer(one_rank_group):
    model, reference = make_model(), make_model()
    opt = ShardedOptimizer(torch.optim.SGD, model.parameters(), lr=0.1, momentum=0.9)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, plain)]
    for step in range(3):
        for m, o in ((model, opt), (reference, plain)):
            train(m, o, 1, 0, 1, start=step)
        for s in schedulers:
            s.step()
    assert opt.local_optimizer.param_groups[0]["lr"] == 0.1 * 0.5**2  # synced at the last step
    assert (flat_params(model) - flat_params(reference)).abs().max() <= ATOL
    with pytest.raises(ValueError, match="lays out its parameters once"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


def test_the_parameters_are_gathered_straight_into_the_flat_buffer(one_rank_group, monkeypatch):
    # dist.all_gather of a list of parts makes NCCL gather into a staging buffer and copy each part
    # out, every step: ZeRO gathers into the flat parameters themselves
    into = []
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    real = getattr(dist, name)
    monkeypatch.setattr(
        dist, name, lambda out, t, group=None: (into.append(out.data_ptr()), real(out, t, group))[1]
    )
    monkeypatch.setattr(dist, "all_gather", lambda *a, **k: pytest.fail("a list of parts"))
    model = make_model()
    opt = ShardedOptimizer(torch.optim.SGD, model.parameters(), lr=0.1)
    train(model, opt, 1, 0, 1)
    assert into == [opt._flat_params.data_ptr()]
