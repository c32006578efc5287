"""PowerSGD hook: error feedback loses nothing over time, rank-r gradients pass exactly, fewer bytes,
and it trains through dpscale's engine (and torch's) at world size 2.

Tolerances: the hook's arithmetic is fp32 matrix products and a QR of tiny matrices, each exact to a
few ulps relative to the gradients' scale (~1); 1e-5 relative leaves a wide margin over that and is
far below what a wrong projection, a lost error term or a mis-averaged Q produces (1e-1 and up).
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dpscale import DistributedDataParallel
from dpscale.engine.hooks import COMPRESSIONS, GradBucket, compression_hook
from dpscale.engine.powersgd import PowerSGDState, powersgd_hook
from dpscale.lab.multirank import run_ranks

REL = 1e-5
# a matrix, a vector, a 3-D tensor (viewed as 6 x 12) and a matrix too small to gain from rank 2
SHAPES = [(16, 12), (12,), (6, 4, 3), (3, 2)]
COMPRESSED_NUMBERS = (16 + 12) * 2 + 12 + (6 + 12) * 2 + 6
UNCOMPRESSED_NUMBERS = 16 * 12 + 12 + 6 * 4 * 3 + 3 * 2


def make_bucket() -> GradBucket:
    params = [torch.zeros(s) for s in SHAPES]  # stand-ins: the hook reads shapes and keys its state by them
    buffer = torch.zeros(sum(p.numel() for p in params))
    views, offsets, off = [], [], 0
    for p in params:
        views.append(buffer[off : off + p.numel()].view_as(p))
        offsets.append(off)
        off += p.numel()
    return GradBucket(0, buffer, params, views, offsets, is_last=True)


def fill(bucket: GradBucket, grads: list[torch.Tensor]) -> torch.Tensor:
    """Write this rank's gradients into the bucket; returns their true average over ranks."""
    for view, g in zip(bucket.gradients(), grads, strict=True):
        view.copy_(g)
    mean = bucket.buffer().clone()
    dist.all_reduce(mean)
    return mean / dist.get_world_size()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# ---- the hook on hand-made buckets ---------------------------------------------------------------


def hook_properties(rank, world, steps):
    out = {}
    # error feedback over `steps` full-rank steps, with and without it
    for feedback in (True, False):
        state = PowerSGDState(None, rank=2, start_iter=0, use_error_feedback=feedback)
        bucket = make_bucket()
        total_out = torch.zeros_like(bucket.buffer())
        total_true = torch.zeros_like(total_out)
        for step in range(steps):
            g = torch.Generator().manual_seed(1000 * step + rank)
            total_true += fill(bucket, [torch.randn(s, generator=g) for s in SHAPES])
            total_out += powersgd_hook(state, bucket).wait()
        residual = torch.zeros_like(total_out)  # mean over ranks of the errors, laid out like the buffer
        for p, view in zip(bucket.parameters(), bucket.gradients(), strict=True):
            if p in state.errors:
                start = view.data_ptr() - bucket.buffer().data_ptr()
                residual[start // 4 : start // 4 + p.numel()] = state.errors[p].reshape(-1)
        dist.all_reduce(residual)
        out[feedback] = {
            "out": total_out,
            "true": total_true,
            "residual": residual / world,
            "bytes": state.last_step_bytes,
            "uncompressed_bytes": state.last_step_uncompressed_bytes,
        }
    # averaged gradients of rank <= r pass exactly, even when each rank's own is full rank
    g = torch.Generator().manual_seed(7)  # the same on every rank
    sign = 1.0 if rank == 0 else -1.0  # world 2: the C terms cancel in the average
    grads = []
    for s in SHAPES:
        n, m = s[0], torch.Size(s).numel() // s[0]
        low = torch.randn(n, 2, generator=g) @ torch.randn(2, m, generator=g) * (rank + 1)
        grads.append((low + sign * torch.randn(n, m, generator=g)).reshape(s))
    bucket = make_bucket()
    mean = fill(bucket, grads)
    out["low_rank"] = {
        "out": powersgd_hook(PowerSGDState(None, rank=2, start_iter=0), bucket).wait(),
        "mean": mean,
    }
    # start_iter: plain averaging first, then compression
    state = PowerSGDState(None, rank=2, start_iter=1)
    bucket = make_bucket()
    mean = fill(bucket, [torch.randn(s) for s in SHAPES])
    plain = powersgd_hook(state, bucket).wait().clone()
    plain_bytes = state.last_step_bytes
    fill(bucket, [torch.randn(s) for s in SHAPES])
    powersgd_hook(state, bucket).wait()
    out["start_iter"] = {"plain": plain, "mean": mean, "bytes": [plain_bytes, state.last_step_bytes]}
    return out


@pytest.fixture(scope="module")
def hook_runs():
    return run_ranks(hook_properties, 2, 6)


@pytest.mark.slow
def test_error_feedback_makes_the_sum_of_updates_plus_residual_the_sum_of_true_averages(hook_runs):
    for r in hook_runs:
        fed = r[True]
        assert rel_err(fed["out"] + fed["residual"], fed["true"]) <= REL
        # and the identity is not trivial: without feedback the dropped part is simply lost
        lost = r[False]
        assert rel_err(lost["out"], lost["true"]) > 0.1
    # every rank applies the same averaged update
    assert torch.equal(hook_runs[0][True]["out"], hook_runs[1][True]["out"])


@pytest.mark.slow
def test_vectors_and_small_matrices_are_averaged_uncompressed(hook_runs):
    fed = hook_runs[0][True]
    vector = slice(192, 192 + 12)  # the (12,) parameter
    small = slice(UNCOMPRESSED_NUMBERS - 6, UNCOMPRESSED_NUMBERS)  # the (3, 2) parameter
    for part in (vector, small):
        torch.testing.assert_close(fed["out"][part], fed["true"][part], rtol=1e-6, atol=1e-6)
        assert not fed["residual"][part].any()


@pytest.mark.slow
def test_an_average_of_rank_at_most_r_passes_exactly(hook_runs):
    for r in hook_runs:
        assert rel_err(r["low_rank"]["out"], r["low_rank"]["mean"]) <= REL


@pytest.mark.slow
def test_bytes_are_the_low_rank_factors_and_the_uncompressed_rest(hook_runs):
    fed = hook_runs[0][True]
    assert fed["uncompressed_bytes"] == 4 * UNCOMPRESSED_NUMBERS
    assert fed["bytes"] == 4 * COMPRESSED_NUMBERS < fed["uncompressed_bytes"]


@pytest.mark.slow
def test_the_first_start_iter_steps_are_plain_averages(hook_runs):
    r = hook_runs[0]["start_iter"]
    torch.testing.assert_close(r["plain"], r["mean"], rtol=1e-6, atol=1e-7)
    assert r["bytes"] == [4 * UNCOMPRESSED_NUMBERS, 4 * COMPRESSED_NUMBERS]


# ---- through the engines -------------------------------------------------------------------------


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5))


def train_with(rank, world, engine, state, steps):
    model = make_model()
    if engine == "torch":
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.002)
    else:
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.002)  # several buckets
    if state is not None:
        ddp.register_comm_hook(state, powersgd_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(64, 12, generator=g), torch.randint(0, 5, (64,), generator=g)
    mine = slice(rank * 32, (rank + 1) * 32)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x[mine]), y[mine])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {
        "params": params,
        "losses": losses,
        "bytes": state and (state.last_step_bytes, state.last_step_uncompressed_bytes),
    }


def engine_runs(rank, world, steps):
    full_rank = dict(rank=32, start_iter=0, min_compression_rate=0)  # r >= min(n, m) for every matrix
    return {
        "plain": train_with(rank, world, "dpscale", None, steps),
        "full_rank": train_with(rank, world, "dpscale", PowerSGDState(**full_rank), steps),
        "torch_full_rank": train_with(rank, world, "torch", PowerSGDState(**full_rank), steps),
        "rank1": train_with(rank, world, "dpscale", PowerSGDState(rank=1, start_iter=2), steps),
    }


@pytest.mark.slow
def test_trains_through_the_dpscale_and_torch_engines_at_world_2():
    runs = run_ranks(engine_runs, 2, 10)
    plain = runs[0]["plain"]["params"]
    for name in ("full_rank", "torch_full_rank", "rank1"):
        # replicas stay identical: every rank computes the same result from the reduced factors
        assert torch.equal(runs[0][name]["params"], runs[1][name]["params"]), name
    # with r >= min(n, m) the projection is the identity: the same training as plain averaging
    for name in ("full_rank", "torch_full_rank"):
        assert rel_err(runs[0][name]["params"], plain) <= REL, name
    # rank 1 from step 3 on: it trains, at least half as fast as plain averaging over these steps
    rank1, first = runs[0]["rank1"]["losses"], runs[0]["plain"]["losses"][0]
    assert all(b < a for a, b in zip(rank1, rank1[1:], strict=False))
    assert first - rank1[-1] >= 0.5 * (first - runs[0]["plain"]["losses"][-1])
    sent, uncompressed = runs[0]["rank1"]["bytes"]
    assert sent < uncompressed / 5


# ---- settings and names --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"rank": 0}, "rank"),
        ({"start_iter": -1}, "start_iter"),
        ({"min_compression_rate": -1.0}, "min_compression_rate"),
    ],
)
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        PowerSGDState(None, **kwargs)


def test_compression_names_map_to_hooks():
    assert COMPRESSIONS == ("none", "fp16", "bf16", "powersgd")
    assert compression_hook("none", None) is None
    assert compression_hook("fp16", None)[1].__name__ == "float16_compress_hook"
    state, hook = compression_hook("powersgd", None)
    assert isinstance(state, PowerSGDState) and hook is powersgd_hook
    with pytest.raises(ValueError, match="compression: unknown 'zip'"):
        compression_hook("zip", None)


# ---- wiring: TrainConfig.engine.compression and `dpscale bench convergence --compression` ----------------


def train_compressed(rank, world):
    from dpscale.train.config import TrainConfig
    from dpscale.train.trainer import Trainer

    config = TrainConfig.from_flat(
        workload="synthetic", max_steps=12, compression="powersgd", progress="none"
    )
    trainer = Trainer(config)
    result = trainer.fit()
    state = trainer.model.reducer.comm_hook[0]
    return result.final_loss, state.iteration, state.last_step_bytes, state.last_step_uncompressed_bytes


@pytest.mark.slow
def test_train_config_compression_registers_the_hook():
    # (torch's engine takes the same register_comm_hook call; the hook itself is tested with it above)
    loss, iteration, sent, uncompressed = run_ranks(train_compressed, 2)[0]
    assert iteration == 12 and sent < uncompressed / 5  # steps 11 and 12 were compressed
    assert loss is not None


def test_compression_is_validated_where_it_is_configured():
    from dpscale.lab.bench.convergence import ConvergenceConfig
    from dpscale.train.config import TrainConfig

    with pytest.raises(ValueError, match="^compression: unknown 'zip'"):
        TrainConfig.from_flat(compression="zip")
    with pytest.raises(ValueError, match="^--compression: unknown 'zip'"):
        ConvergenceConfig(samples=640, compression="zip")
    assert ConvergenceConfig(samples=640, compression="powersgd").compression == "powersgd"


# ---- checkpoints ----------------------------------------------------------------------------------


def _compressed_state(world: int = 1) -> tuple[PowerSGDState, list[tuple[str, torch.Tensor]]]:
    bucket = make_bucket()
    named = [(f"p{i}", p) for i, p in enumerate(bucket.parameters())]
    state = PowerSGDState(None, rank=2, start_iter=0)
    for view in bucket.gradients():
        view.copy_(torch.randn(view.shape, generator=torch.Generator().manual_seed(view.numel())))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=world)
    try:
        powersgd_hook(state, bucket).wait()
    finally:
        dist.destroy_process_group()
    return state, named


def test_state_dict_round_trips_by_parameter_name():
    state, named = _compressed_state()
    saved = state.state_dict(named)
    assert set(saved["q"]) == set(saved["errors"]) == {"p0", "p2"}  # the compressed matrices
    assert saved["iteration"] == 1
    fresh_params = [(n, torch.zeros(p.shape)) for n, p in named]  # new objects, as after a restart
    fresh = PowerSGDState(None, rank=2, start_iter=0)
    fresh.load_state_dict(saved, fresh_params)
    assert fresh.iteration == 1 and fresh.total_bytes == state.total_bytes
    for (name, new), (_, old) in zip(fresh_params, named, strict=True):
        if name in saved["q"]:
            assert torch.equal(fresh.q[new], state.q[old]) and torch.equal(
                fresh.errors[new], state.errors[old]
            )


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda s: s["q"].update(nope=torch.zeros(2, 2)), "'nope', which is not a parameter here"),
        (lambda s: s["q"].update(p0=torch.zeros(12, 3)), "has shape (12, 3), this run expects (12, 2)"),
        (lambda s: s.update(iteration=-1), "iteration is -1"),
    ],
)
def test_load_state_dict_names_what_does_not_fit(change, words):
    state, named = _compressed_state()
    saved = state.state_dict(named)
    change(saved)
    with pytest.raises(ValueError) as err:
        PowerSGDState(None, rank=2).load_state_dict(saved, named)
    assert words in str(err.value)


def test_merging_ranks_keeps_the_mean_error():
    """At another world size every rank gets the old ranks' mean error, so the correction the next
    averaged gradient absorbs, mean over ranks of e, is unchanged."""
    a = {"iteration": 5, "q": {"w": torch.ones(3, 2)}, "errors": {"w": torch.full((4, 3), 1.0)}}
    b = {"iteration": 5, "q": {"w": torch.ones(3, 2)}, "errors": {"w": torch.full((4, 3), 3.0)}}
    merged = PowerSGDState.merge_rank_states([a, b])
    assert torch.equal(merged["errors"]["w"], torch.full((4, 3), 2.0))
    assert merged["iteration"] == 5 and torch.equal(merged["q"]["w"], a["q"]["w"])
