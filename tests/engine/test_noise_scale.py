"""Gradient noise scale: the estimator's algebra, and the engine's figure against brute force."""

import math

import pytest
import torch
from torch import nn

from dpscale import DistributedDataParallel
from dpscale.engine.noise_scale import NoiseScaleEstimator, NoiseScaleObserver
from dpscale.lab.multirank import run_ranks
from support.echo_group import EchoGroup

# A linear regression whose per-sample gradients are cheap to compute one by one: at fixed
# weights w, sample i's gradient is (w.x_i - y_i) x_i, and tr(Sigma) / |G|^2 over the whole
# dataset is the noise scale the engine must find from its two batch sizes alone.
N_SAMPLES, DIM, PER_RANK_BATCH = 8192, 256, 64


def _problem():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_SAMPLES, DIM, generator=g, dtype=torch.float64)
    w_true = torch.randn(DIM, generator=g, dtype=torch.float64)
    y = x @ w_true + torch.randn(N_SAMPLES, generator=g, dtype=torch.float64)
    # away from the optimum by about the label noise: B_simple ~ 2 x DIM, a few times the batch
    w = w_true + torch.randn(DIM, generator=g, dtype=torch.float64) / DIM**0.5
    return x, y, w


def brute_force_b_simple() -> float:
    x, y, w = _problem()
    per_sample = (x @ w - y)[:, None] * x  # one gradient per row
    mean = per_sample.mean(0)
    trace_sigma = ((per_sample - mean) ** 2).sum(1).mean()  # population covariance: batches are drawn iid
    return float(trace_sigma / mean.dot(mean))


def test_estimator_recovers_known_norms():
    # |G|^2 = 4, tr(Sigma) = 64: expected |G_B|^2 = 4 + 64/B
    est = NoiseScaleEstimator(ema_decay=0.5)
    for _ in range(3):
        est.update(small_sq=4 + 64 / 8, big_sq=4 + 64 / 32, b_small=8, b_big=32)
    e = est.estimate()
    assert e.grad_sq == pytest.approx(4) and e.trace_sigma == pytest.approx(64)
    assert e.b_simple == pytest.approx(16) and e.updates == 3


def test_estimator_input_checks_and_empty_state():
    est = NoiseScaleEstimator()
    assert est.b_simple is None and est.estimate() is None
    with pytest.raises(ValueError, match="b_big > b_small"):
        est.update(small_sq=1, big_sq=1, b_small=4, b_big=4)
    with pytest.raises(ValueError, match="ema_decay"):
        NoiseScaleEstimator(ema_decay=1.0)
    est.update(small_sq=float("nan"), big_sq=1, b_small=1, b_big=2)  # skipped step: ignored
    assert est.updates == 0


def measure_at_fixed_weights(rank, world, steps, decay):
    x, y, w = _problem()
    model = nn.Linear(DIM, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(w[None])
    ddp = DistributedDataParallel(model)
    ddp.set_noise_scale_observer(NoiseScaleObserver(every=1, estimator=NoiseScaleEstimator(ema_decay=decay)))
    g = torch.Generator().manual_seed(100 + rank)  # each rank draws its own batches, iid
    for _ in range(steps):
        idx = torch.randint(0, N_SAMPLES, (PER_RANK_BATCH,), generator=g)
        loss = 0.5 * ((ddp(x[idx]).squeeze(1) - y[idx]) ** 2).mean()
        loss.backward()
        ddp.zero_grad(set_to_none=True)  # lr 0: the weights never move
    stats = ddp.last_step_stats
    run = ddp.noise_scale.estimator.run_b_simple
    ddp.close()
    return stats.gradient_noise_scale * PER_RANK_BATCH, run * PER_RANK_BATCH, stats


@pytest.mark.slow
def test_engine_noise_scale_matches_per_sample_brute_force():
    """The engine's figure is each rank's own (its local norm against the average, no extra
    collective): unbiased but noisier than the training loop's, which averages the local norms
    over ranks (tests/train/test_noise_scale_train.py holds that one to 10%)."""
    expected = brute_force_b_simple()
    results = run_ranks(measure_at_fixed_weights, 2, 2000, 0.999)
    for b_simple, run_b_simple, stats in results:
        assert run_b_simple == pytest.approx(expected, rel=0.10), (run_b_simple, expected)
        assert b_simple == pytest.approx(expected, rel=0.25), (b_simple, expected)
        assert stats.grad_sq_norm_local > stats.grad_sq_norm_global > 0
    # the two ranks see the same averaged gradient
    assert results[0][2].grad_sq_norm_global == pytest.approx(results[1][2].grad_sq_norm_global)


def _net():
    # buckets of large tensors (divided per tensor as gradients arrive) and of small ones (divided
    # once per bucket at launch): the local norm must be right for both
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3000), nn.ReLU(), nn.Linear(3000, 3))


def one_step_norms(rank, world, with_hook):
    torch.manual_seed(0)
    model = _net()
    ddp = DistributedDataParallel(model, bucket_cap_mb=1e-5, first_bucket_cap_mb=1e-5)  # several buckets
    ddp.set_noise_scale_observer(NoiseScaleObserver(every=1))
    if with_hook:
        from dpscale.engine import allreduce_hook

        ddp.register_comm_hook(None, allreduce_hook)
    xb = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    ddp(xb).pow(2).sum().backward()
    stats = ddp.last_step_stats
    # the large tensors' norms were taken in the hook, as each arrived (fused with the copy)
    per_tensor = sum(len(b.tensor_sq) for b in ddp.reducer.buckets)
    # a loop that takes the reduced norm itself: the engine takes the local one only
    ddp.noise_scale.wants_reduced_norm = False
    updates = ddp.noise_scale.estimator.updates
    ddp.zero_grad(set_to_none=True)
    ddp(xb).pow(2).sum().backward()
    local_only = ddp.last_step_stats
    assert ddp.noise_scale.estimator.updates == updates  # no pair, no update of the rank's figure
    ddp.set_noise_scale_observer(None)
    ddp.zero_grad(set_to_none=True)
    ddp(xb).pow(2).sum().backward()
    off = ddp.last_step_stats
    ddp.close()
    local = stats.grad_sq_norm_local
    return (
        len(stats.buckets),
        local,
        stats.grad_sq_norm_global,
        off.grad_sq_norm_local,
        per_tensor,
        local_only,
    )


@pytest.mark.parametrize("with_hook", [False, True])
@pytest.mark.slow
def test_engine_norms_equal_local_and_averaged_gradients(with_hook):
    results = run_ranks(one_step_norms, 2, with_hook)
    torch.manual_seed(0)
    model = _net()
    grads = []
    for rank in range(2):
        model.zero_grad()
        model(torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))).pow(2).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    mean = (grads[0] + grads[1]) / 2
    for rank, (n_buckets, local, reduced, off, per_tensor, local_only) in enumerate(results):
        assert n_buckets > 1 and per_tensor > 0
        assert local_only.grad_sq_norm_local == local and local_only.grad_sq_norm_global is None
        assert local == pytest.approx(float(grads[rank].dot(grads[rank])), rel=1e-5)
        assert reduced == pytest.approx(float(mean.dot(mean)), rel=1e-5)
        assert off is None  # measure_noise_scale=False: nothing measured
    assert math.isfinite(results[0][1])


def measured_steps(rank, world, every):
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Linear(4, 2))
    ddp.set_noise_scale_observer(NoiseScaleObserver(every=every))
    seen = []
    for _ in range(5):
        ddp(torch.randn(3, 4)).sum().backward()
        seen.append(ddp.last_step_stats.grad_sq_norm_local is not None)
    updates = ddp.noise_scale.estimator.updates
    ddp.close()
    return seen, updates


@pytest.mark.slow
def test_noise_scale_every_measures_the_same_steps_on_every_rank():
    for seen, updates in run_ranks(measured_steps, 2, 2):
        assert seen == [True, False, True, False, True] and updates == 3


@pytest.mark.parametrize(("world", "measured"), [(1, False), (2, True)])
def test_one_rank_takes_no_norms(world, measured):
    # one rank's gradient is its average: no pair to measure, so the engine reads nothing more
    ddp = DistributedDataParallel(nn.Linear(4, 2), process_group=EchoGroup(world), init_sync=False)
    ddp.set_noise_scale_observer(NoiseScaleObserver(every=1))
    ddp(torch.randn(3, 4)).sum().backward()
    assert (ddp.last_step_stats.grad_sq_norm_local is not None) == measured
    ddp.close()
