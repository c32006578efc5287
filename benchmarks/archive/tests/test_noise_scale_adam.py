"""benchmarks/archive/noise_scale_adam.py: Adam's preconditioner and the noise scale in its norm (no process)."""

import types

import noise_scale_adam as adam
import pytest
import torch


def test_the_adam_preconditioner_is_the_one_adamw_divides_its_step_by():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    opt = torch.optim.AdamW([p], lr=0.1, betas=(0.0, 0.9), eps=1e-3, weight_decay=0.0)
    assert adam.adam_preconditioner(opt, [p]) is None  # no second moments yet
    for _ in range(3):
        before, p.grad = p.detach().clone(), torch.randn(5)
        opt.step()
    # beta1 = 0: the step is -lr x g x P with P from the second moments including this step's g
    (weights,) = adam.adam_preconditioner(opt, [p])
    assert p.detach() - before == pytest.approx(-0.1 * p.grad * weights, rel=1e-5)
    sgd = torch.optim.SGD([p], lr=0.1)
    assert adam.adam_preconditioner(sgd, [p]) is None


def test_the_preconditioned_noise_is_the_micro_batch_against_the_step_in_adams_norm():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    task = types.SimpleNamespace(
        collate=lambda items: (torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])),
        loss=lambda out, target: ((out - target) ** 2).sum(dim=1),
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model.weight.grad = torch.tensor([[1.0, 4.0, 0.25]])  # P = 1, 1/4, 4: unlike the plain norm
    opt.step()  # second moments to weight by
    loss = task.loss(model(x), y).mean()
    (full,) = torch.autograd.grad(loss, [model.weight])
    model.weight.grad = full.clone()  # the accumulated step gradient, as after the reduction
    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(module=model),
        optimizer=opt,
        task=task,
        train_data=list(zip(x, y, strict=True)),
        device=torch.device("cpu"),
        state=types.SimpleNamespace(global_batch=8),
    )
    meter = adam.PreconditionedNoise()
    meter.on_batch(trainer, types.SimpleNamespace(micro_batches=[[0, 1, 2, 3], [4, 5, 6, 7]]))
    meter.after_reduce(trainer, [model.weight.grad])
    (w,) = adam.adam_preconditioner(opt, [model.weight])
    (micro,) = torch.autograd.grad(task.loss(model(x[:4]), y[:4]).mean(), [model.weight])
    small, big = float((w * micro**2).sum()), float((w * full**2).sum())
    assert meter.estimator.state_dict()["grad_sq_sum"] == pytest.approx((8 * big - 4 * small) / 4)
    assert meter.estimator.state_dict()["trace_sum"] == pytest.approx((small - big) / (1 / 4 - 1 / 8))
    assert torch.equal(model.weight.grad, full)  # the optimizer's gradient is left alone
