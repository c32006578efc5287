"""AdaScale's gain: how much further a step of a large batch may go than one of the base batch.

Johnson, Agrawal, Gu and Guestrin, "AdaScale SGD: A User-Friendly Algorithm for Distributed
Training" (ICML 2020): with a batch S times the base batch, scale the base learning rate by

    r = (sigma^2 + |G|^2) / (sigma^2 / S + |G|^2),   1 <= r <= S,

where sigma^2 is the variance (trace of the covariance) of the base batch's gradient and |G|^2 the
squared norm of the true gradient. With the per-sample trace tr(Sigma) and the simple noise scale
B_simple = tr(Sigma) / |G|^2 that the loop already measures (noise_scale.py), sigma^2 =
tr(Sigma) / b for a base batch of b samples, so

    r = (B_simple / b + 1) / (B_simple / (S b) + 1).

Large noise (B_simple >> S b): r ~ S, the linear rule; small noise (B_simple << b): r ~ 1, a big
batch is no better than a small one. The paper also stretches the schedule by counting progress in
sum(r) instead of steps; here the gain multiplies whatever the scheduler gives (warm-up included),
and the step count stays the schedule's clock.
"""

from __future__ import annotations

import math

from dpscale.train.callbacks import TrainerCallback


def adascale_gain(b_simple: float | None, *, base_batch: float, scale: float) -> float:
    """r for a global batch of `scale` x `base_batch` samples; 1 while no noise scale is known
    (or it is not positive: then the estimate says nothing usable yet)."""
    if scale < 1 or base_batch <= 0:
        raise ValueError(f"need scale >= 1 and base_batch > 0, got scale={scale}, base_batch={base_batch}")
    if b_simple is None or not math.isfinite(b_simple) or b_simple <= 0:
        return 1.0
    noise = b_simple / base_batch
    return (noise + 1.0) / (noise / scale + 1.0)


class AdaScaleGain(TrainerCallback):
    """Multiplies the learning rate of each step by AdaScale's gain for the global batch in force.

    `base_batch`: the batch (samples) the configured learning rate was tuned for. The gain uses the
    noise scale smoothed up to the previous step, which every rank holds alike, so all ranks take
    the same rate. The scheduler sets the rate afresh each step (LambdaLR computes it from the base
    rate), so the multiplication does not compound. `gains` keeps each step's gain.
    """

    def __init__(self, *, base_batch: int):
        if base_batch < 1:
            raise ValueError(f"base_batch must be >= 1, got {base_batch}")
        self.base_batch = base_batch
        self.gains: list[float] = []

    def after_reduce(self, trainer, grads) -> None:
        scale = trainer.state.global_batch / self.base_batch
        gain = adascale_gain(trainer.noise_scale.b_simple, base_batch=self.base_batch, scale=max(1.0, scale))
        for group in trainer.optimizer.param_groups:
            group["lr"] *= gain
        self.gains.append(gain)
