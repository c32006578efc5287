"""The noise scale of Adam's preconditioned gradient, tr(P Sigma) / G^T P G, for
benchmarks/archive/noise_scale_validation.py's fourth prediction (docs/noise-scale.md, "The noise scale of
a preconditioned update", derives it): P = diag(1 / (sqrt(v_hat) + eps)) from the optimizer's
exp_avg_sq, measured from the same micro-batch and accumulated gradient pair as the plain noise
scale (the micro-batch's gradient is recomputed, a forward and backward on it per step). It stays
beside the benchmark: it predicted worse than the plain noise scale on both AdamW tasks, so the
trainer does not offer it."""

from __future__ import annotations

import torch

from dpscale.engine.noise_scale import NoiseScaleEstimator
from dpscale.train.callbacks import TrainerCallback
from dpscale.workloads.task import call_model, to_device


def adam_preconditioner(optimizer: torch.optim.Optimizer, params: list) -> list[torch.Tensor] | None:
    """P = 1 / (sqrt(v_hat) + eps) per parameter, as Adam's next step divides by it (from the second
    moments of the steps so far); None for an optimizer without exp_avg_sq, or before its first step."""
    weights = []
    for group in optimizer.param_groups:
        beta2, eps = group.get("betas", (None, None))[1], group.get("eps")
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if p.grad is None:
                continue
            if "exp_avg_sq" not in state or beta2 is None:
                return None
            v_hat = state["exp_avg_sq"] / (1 - beta2 ** float(state["step"]))
            weights.append(1.0 / (v_hat.sqrt() + eps))
    return weights if len(weights) == len(params) else None


class PreconditionedNoise(TrainerCallback):
    """tr(P Sigma) / G^T P G from the first micro-batch's gradient against the accumulated one, both
    measured in the P-weighted norm |g|_P^2 = sum_i P_i g_i^2 (Adam's P of this step)."""

    def __init__(self):
        self.estimator = NoiseScaleEstimator()
        self._first: list[int] = []

    def on_batch(self, trainer, batch) -> None:
        self._first = batch.micro_batches[0]

    def after_reduce(self, trainer, grads) -> None:
        module = trainer.model.module
        params = [p for p in module.parameters() if p.grad is not None]
        weights = adam_preconditioner(trainer.optimizer, params)
        if weights is None or not 0 < len(self._first) < trainer.state.global_batch:
            return
        x, y = to_device(trainer.task.collate([trainer.train_data[i] for i in self._first]), trainer.device)
        # autograd.grad on the bare module: the engine's post-accumulate hooks do not fire, p.grad
        # (the accumulated gradient the optimizer is about to use) stays as it is
        loss = trainer.task.loss(call_model(module, x), y).float().mean()
        micro = torch.autograd.grad(loss, params)
        small = sum(float((w * g.float() ** 2).sum()) for w, g in zip(weights, micro, strict=True))
        big = sum(float((w * p.grad.float() ** 2).sum()) for w, p in zip(weights, params, strict=True))
        self.estimator.update(
            small_sq=small, big_sq=big, b_small=len(self._first), b_big=trainer.state.global_batch
        )
