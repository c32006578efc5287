"""The training loop's gradient noise scale, in samples, the same on every rank.

The engine measures, per synced step, this rank's squared gradient norm before the reduction and
the averaged one after (engine/noise_scale.py). Here the local norms are averaged over ranks (in
the step-flags collective the loop makes anyway, so no extra message), which cuts the estimate's
variance by the world size, and batches are counted in samples:

- W > 1 workers: B_small = one worker's samples per step, B_big = the global batch.
- one worker with accumulation: the first micro-batch's gradient (taken before the next
  micro-batch adds to it) against the accumulated one; B_small = that micro-batch's samples.
- one worker, no accumulation: there is only one gradient per step, hence no estimate.

The estimates use the gradients as reduced, so a lossy comm hook (PowerSGD) biases them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..engine.noise_scale import NoiseScaleEstimator


def grad_sq_norm(params: Iterable[torch.nn.Parameter]) -> float:
    """Sum of squared gradient entries over `params` (dense gradients only)."""
    sq = [p.grad.detach().float().pow(2).sum() for p in params if p.grad is not None and not p.grad.is_sparse]
    return float(torch.stack(sq).sum()) if sq else 0.0


@dataclass
class StepNorms:
    """One step's inputs to the estimator; `small_sq` is this rank's until averaged over ranks."""

    small_sq: float
    big_sq: float
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
        self, *, engine_stats, micro_sq: float | None, micro_count: int, global_count: int, params
    ) -> StepNorms | None:
        """This step's norms, or None when this configuration gives no small/big pair.

        Every rank gets the same answer (it depends on the world size, the engine and the step's
        shape only), so the collective that averages `small_sq` has the same shape everywhere."""
        if not self.enabled or global_count <= 0:
            return None
        if self.world_size > 1:
            local = getattr(engine_stats, "grad_sq_norm_local", None)
            if local is None:  # torch's engine, or the measurement turned off in ours
                return None
            big_sq, per_worker = engine_stats.grad_sq_norm_global, global_count / self.world_size
            return StepNorms(local, big_sq, per_worker, global_count)
        if micro_sq is None or not 0 < micro_count < global_count:
            return None
        # the loop scales each micro-batch's loss sum by 1/global_count: the first micro-batch's
        # gradient is its mean gradient times micro_count/global_count
        scale = (global_count / micro_count) ** 2
        return StepNorms(micro_sq * scale, grad_sq_norm(params), micro_count, global_count)

    def update(self, norms: StepNorms, mean_small_sq: float) -> None:
        n = norms
        self.estimator.update(small_sq=mean_small_sq, big_sq=n.big_sq, b_small=n.b_small, b_big=n.b_big)

    @property
    def b_simple(self) -> float | None:
        return self.estimator.b_simple

    def state_dict(self) -> dict:
        return self.estimator.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint's sums; an empty dict (a checkpoint older than them) starts afresh."""
        if state:
            self.estimator.load_state_dict(state)
