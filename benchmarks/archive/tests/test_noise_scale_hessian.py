"""benchmarks/archive/noise_scale_hessian.py: B_noise = tr(H Sigma) / G^T H G against brute force (no process)."""

import types

import noise_scale_adam as adam
import noise_scale_hessian as hessian
import pytest
import torch


def _regression(n: int, dim: int):
    """A linear least-squares problem with features of very different scales, so that H (and the
    Hessian-weighted noise scale) is far from the identity (and B_simple)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g) * torch.logspace(0, -1, dim)
    y = x @ torch.randn(dim, 1, generator=g) + 0.5 * torch.randn(n, 1, generator=g)
    task = types.SimpleNamespace(
        collate=lambda items: (torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])),
        loss=lambda out, target: ((out - target) ** 2).sum(dim=1),
    )
    return x, y, task


def _trainer(model, opt, task, x, y, global_batch):
    return types.SimpleNamespace(
        model=types.SimpleNamespace(module=model),
        optimizer=opt,
        task=task,
        train_data=list(zip(x, y, strict=True)),
        device=torch.device("cpu"),
        state=types.SimpleNamespace(global_batch=global_batch),
        step=0,
    )


def test_the_quadratic_forms_are_v_h_v():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    loss = w[0] ** 2 * w[1] + 3 * w[1] ** 2  # H at (1, 2) = [[2 w1, 2 w0], [2 w0, 6]] = [[4, 2], [2, 6]]
    forms = hessian.hessian_quadratic_forms(
        loss, [w], [[torch.tensor([1.0, 0.0])], [torch.tensor([1.0, 1.0])]]
    )
    assert forms == pytest.approx([4.0, 14.0])


def test_the_hessian_noise_scale_matches_brute_force_at_fixed_weights():
    torch.manual_seed(0)
    x, y, task = _regression(4096, 16)
    model = torch.nn.Linear(16, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    # brute force over the whole dataset: per-sample gradients g_i = 2 (w.x_i - y_i) x_i, H = 2 mean x x^T
    with torch.no_grad():
        per_sample = 2 * (x @ model.weight.T - y) * x
        big_g = per_sample.mean(0)
        sigma = torch.cov(per_sample.T, correction=0)
        h = 2 * x.T @ x / len(x)
    exact = float(torch.trace(h @ sigma) / (big_g @ h @ big_g))
    simple = float(torch.trace(sigma) / (big_g @ big_g))
    assert abs(exact / simple - 1) > 0.3  # the problem tells the two apart
    meter, batch = hessian.HessianNoise(seed=0), 64
    trainer = _trainer(model, opt, task, x, y, batch)
    draw = torch.Generator().manual_seed(1)
    for _ in range(1500):
        idx = torch.randint(0, len(x), (batch,), generator=draw).tolist()
        loss = task.loss(model(x[idx]), y[idx]).mean()
        (model.weight.grad,) = torch.autograd.grad(loss, [model.weight])
        meter.on_batch(trainer, types.SimpleNamespace(micro_batches=[idx[: batch // 2], idx[batch // 2 :]]))
        meter.after_reduce(trainer, [model.weight.grad])
    sums = meter.plain.state_dict()
    assert sums["trace_sum"] / sums["grad_sq_sum"] == pytest.approx(exact, rel=0.1)
    assert meter.preconditioned.updates == 0  # SGD: no preconditioned form


def test_adams_form_is_the_pair_measured_on_p_g_and_training_is_left_alone():
    torch.manual_seed(0)
    x, y, task = _regression(8, 3)
    model = torch.nn.Linear(3, 1, bias=False)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model.weight.grad = torch.tensor([[1.0, 4.0, 0.25]])
    opt.step()  # second moments to weight by
    (full,) = torch.autograd.grad(task.loss(model(x), y).mean(), [model.weight])
    model.weight.grad = full.clone()
    trainer = _trainer(model, opt, task, x, y, 8)
    meter = hessian.HessianNoise(seed=3)
    rng_before = torch.random.get_rng_state()
    meter.on_batch(trainer, types.SimpleNamespace(micro_batches=[[0, 1, 2, 3], [4, 5, 6, 7]]))
    meter.after_reduce(trainer, [model.weight.grad])
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # the trainer's random stream is untouched
    assert torch.equal(model.weight.grad, full)  # the optimizer's gradient too
    (w,) = adam.adam_preconditioner(opt, [model.weight])
    (micro,) = torch.autograd.grad(task.loss(model(x[:4]), y[:4]).mean(), [model.weight])
    h_batch = torch.randint(0, 8, (8,), generator=torch.Generator().manual_seed(10_003)).tolist()
    h = 2 * x[h_batch].T @ x[h_batch] / 8  # the linear model's Hessian on the independent batch
    small, big = (w * micro).flatten(), (w * full).flatten()
    small_sq, big_sq = float(small @ h @ small), float(big @ h @ big)
    sums = meter.preconditioned.state_dict()
    assert sums["grad_sq_sum"] == pytest.approx((8 * big_sq - 4 * small_sq) / 4, rel=1e-5)
    assert sums["trace_sum"] == pytest.approx((small_sq - big_sq) / (1 / 4 - 1 / 8), rel=1e-5)
