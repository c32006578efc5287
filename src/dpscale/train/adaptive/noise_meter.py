"""The training loop's gradient noise scale, in samples, the same on every rank.

The engine measures, per synced step, this rank's squared gradient norm before the reduction and
the averaged one after (engine/noise_scale.py). Here the local norms are averaged over ranks (in
the step-flags collective the loop makes anyway, so no extra message), which cuts the estimate's
variance by the world size, and batches are counted in samples:

- W > 1 workers: B_small = one worker's samples per step, B_big = the global batch.
- one worker with accumulation: the first micro-batch's gradient (taken before the next
  micro-batch adds to it) against the accumulated one; B_small = that micro-batch's samples.
- one worker, no accumulation: there is only one gradient per step, hence no estimate.

The estimates use the gradients as reduced, so a lossy comm hook (PowerSGD) biases them. The norms
stay tensors on the device until the step-flags collective brings them to the host with the loss
and the skip decision (the step's one sync).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from dpscale.engine.noise_scale import NoiseScaleEstimator
from dpscale.engine.observers import GradNormTensors


def grad_sq_norm(params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """Sum of squared gradient entries over `params` (dense gradients only): a 0-d float64 tensor
    on the gradients' device (0 on the CPU without any)."""
    sq = [p.grad.detach().float().pow(2).sum() for p in params if p.grad is not None and not p.grad.is_sparse]
    return torch.stack(sq).sum().double() if sq else torch.zeros((), dtype=torch.float64)


@dataclass
class StepNorms:
    """One step's inputs to the estimator, unscaled (fp16's loss scale divided out), as 0-d
    float64 tensors on the device; `small_sq` is this rank's until averaged over ranks; `big_sq`
    None: the norm of the reduced gradients that the loop takes anyway (for its skip check) is
    the big-batch one, no second read is needed."""

    small_sq: torch.Tensor
    big_sq: torch.Tensor | None
    b_small: float
    b_big: float


class NoiseScaleMeter:
    def __init__(self, world_size: int, *, enabled: bool = True, every: int = 1, ema_decay: float = 0.95):
        self.world_size = world_size
        self.enabled = enabled
        self.every = every  # measure on every this many steps (the engine counts the same way)
        self.estimator = NoiseScaleEstimator(ema_decay=ema_decay)

    def wants_micro_norm(self, micro_batches: int, step: int) -> bool:
        """Whether the loop must take the first micro-batch's gradient norm at 0-based `step`."""
        return self.enabled and self.world_size == 1 and micro_batches > 1 and step % self.every == 0

    def step_norms(
        self,
        *,
        engine_norms: GradNormTensors | None,
        micro_sq: torch.Tensor | None,
        micro_count: int,
        global_count: int,
        params,
        loss_scale: torch.Tensor | float = 1.0,
    ) -> StepNorms | None:
        """This step's norms, or None when this configuration gives no small/big pair.

        Called before the gradients are unscaled; `loss_scale` (fp16, a tensor: reading it would
        sync) is divided out here. Every rank gets the same answer (it depends on the world size,
        the engine and the step's shape only), so the collective that averages `small_sq` has the
        same shape everywhere."""
        if not self.enabled or global_count <= 0:
            return None
        # the scale is a power of two: multiplying by its inverse square is exact
        unscale = 1.0 / loss_scale**2 if isinstance(loss_scale, float) else 1.0 / loss_scale.double() ** 2
        if self.world_size > 1:
            if engine_norms is None:  # torch's engine, or the measurement turned off in ours
                return None
            # None unless the engine was asked for it (a model with sparse gradients, see Trainer)
            big_sq = engine_norms.reduced_sq
            big_sq = None if big_sq is None else big_sq * unscale
            small_sq = engine_norms.local_sq * unscale
            return StepNorms(small_sq, big_sq, global_count / self.world_size, global_count)
        if micro_sq is None or not 0 < micro_count < global_count:
            return None
        # the loop scales each micro-batch's loss sum by 1/global_count: the first micro-batch's
        # gradient is its mean gradient times micro_count/global_count
        scale = (global_count / micro_count) ** 2
        # the loop's norm covers sparse gradients too, micro_sq does not: then dense ones only
        params = list(params)
        sparse = any(p.grad is not None and p.grad.is_sparse for p in params)
        big_sq = grad_sq_norm(params) * unscale if sparse else None
        return StepNorms(micro_sq * scale * unscale, big_sq, micro_count, global_count)

    def update(
        self, norms: StepNorms, mean_small_sq: float, *, reduced_sq: float, big_sq: float | None
    ) -> None:
        """`mean_small_sq`: `norms.small_sq` averaged over ranks; `big_sq`: `norms.big_sq` read on
        the host (None with it); `reduced_sq`: the squared norm of the (unscaled) reduced
        gradients, used when the engine did not take it (`big_sq` None)."""
        n = norms
        big = reduced_sq if big_sq is None else big_sq
        self.estimator.update(small_sq=mean_small_sq, big_sq=big, b_small=n.b_small, b_big=n.b_big)

    @property
    def b_simple(self) -> float | None:
        return self.estimator.b_simple

    def state_dict(self) -> dict:
        return self.estimator.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint's sums; an empty dict (a checkpoint older than them) starts afresh."""
        if state:
            self.estimator.load_state_dict(state)
