"""The noise scale the law S(B) = S_min (1 + B_noise / B) is written in, B_noise = tr(H Sigma) / G^T H G
(McCandlish et al. 2018, eq. 2.7), for benchmarks/archive/noise_scale_validation.py's fifth and sixth
predictions. B_simple (what the trainer reports) is this with H = I (their eq. 2.8); where the
curvature weighs the gradient and the noise differently the two differ, and the law's B_noise is
the one that sets the best rate and the steps.

The appendix A.1 pair carries over to any fixed quadratic form: for a gradient estimate g_b over b
samples, E[g_b^T H g_b] = G^T H G + tr(H Sigma) / b, so the first micro-batch's gradient against the
accumulated one, each measured in the H-norm, give unbiased G^T H G and tr(H Sigma) as before. H
is the loss's Hessian at this step's weights, applied by a Hessian-vector product (double backward)
on an independent batch of B samples drawn for the purpose: independent of both gradients given the
weights, so E[g^T H_est g] = E[g^T H g]. For an Adam-family optimizer the update is P g with
P = diag(1 / (sqrt(v_hat) + eps)), and the same expansion gives B_P = tr(P H P Sigma) / G^T P H P G
(docs/noise-scale.md derives it): the pair measured on u = P g. Both are measured on AdamW tasks
(prediction 5 plain, 6 preconditioned); SGD has prediction 5 only.

It stays beside the benchmark: two more backward passes and two double backwards per measured step.
"""

from __future__ import annotations

import torch
from noise_scale_adam import adam_preconditioner  # benchmarks/archive/, beside this script
from torch.nn.attention import SDPBackend, sdpa_kernel

from dpscale.engine.noise_scale import NoiseScaleEstimator
from dpscale.train.callbacks import TrainerCallback
from dpscale.workloads.task import call_model, to_device


def hessian_quadratic_forms(
    loss: torch.Tensor, params: list, vectors: list[list[torch.Tensor]]
) -> list[float]:
    """v^T H v for each v (a list of tensors shaped like params), H the Hessian of `loss`."""
    grads = torch.autograd.grad(loss, params, create_graph=True)
    forms = []
    for i, v in enumerate(vectors):
        hv = torch.autograd.grad(grads, params, grad_outputs=v, retain_graph=i < len(vectors) - 1)
        forms.append(sum(float((a.double() * b.double()).sum()) for a, b in zip(v, hv, strict=True)))
    return forms


class HessianNoise(TrainerCallback):
    """B_noise = tr(H Sigma) / G^T H G (and, for Adam, tr(P H P Sigma) / G^T P H P G) from the
    first micro-batch's gradient against the accumulated one, on the steps before `until_step`."""

    def __init__(self, seed: int, *, until_step: int | None = None):
        self.plain = NoiseScaleEstimator()
        self.preconditioned = NoiseScaleEstimator()
        self.until_step = until_step
        self._rng = torch.Generator().manual_seed(10_000 + seed)  # the trainer's own streams stay as they are
        self._first: list[int] = []

    def on_batch(self, trainer, batch) -> None:
        self._first = batch.micro_batches[0]

    def _loss(self, trainer, indices) -> torch.Tensor:
        x, y = to_device(trainer.task.collate([trainer.train_data[i] for i in indices]), trainer.device)
        return trainer.task.loss(call_model(trainer.model.module, x), y).float().mean()

    def after_reduce(self, trainer, grads) -> None:
        global_batch = trainer.state.global_batch
        if not 0 < len(self._first) < global_batch:
            return
        if self.until_step is not None and trainer.step >= self.until_step:
            return
        # fork_rng: a model that draws random numbers trains as without this; the math kernel of
        # scaled_dot_product_attention, since the CPU's flash kernel has no double backward
        with torch.random.fork_rng(devices=[]), sdpa_kernel(SDPBackend.MATH):
            self._measure(trainer, global_batch)

    def _measure(self, trainer, global_batch: int) -> None:
        params = [p for p in trainer.model.module.parameters() if p.grad is not None]
        # autograd.grad on the bare module: the engine's hooks do not fire and p.grad (the
        # accumulated gradient the optimizer is about to use) stays as it is
        small = [g.detach() for g in torch.autograd.grad(self._loss(trainer, self._first), params)]
        big = [p.grad.detach().float() for p in params]
        vectors = [small, big]
        weights = adam_preconditioner(trainer.optimizer, params)
        if weights is not None:
            vectors += [[w * g for w, g in zip(weights, v, strict=True)] for v in (small, big)]
        h_batch = torch.randint(0, len(trainer.train_data), (global_batch,), generator=self._rng).tolist()
        forms = hessian_quadratic_forms(self._loss(trainer, h_batch), params, vectors)
        sizes = dict(b_small=len(self._first), b_big=global_batch)
        self.plain.update(small_sq=forms[0], big_sq=forms[1], **sizes)
        if weights is not None:
            self.preconditioned.update(small_sq=forms[2], big_sq=forms[3], **sizes)
