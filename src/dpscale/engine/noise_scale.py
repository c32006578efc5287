"""Gradient noise scale from two gradient estimates that data parallelism computes anyway.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", appendix A.1): with
|G_small|^2 the squared norm of a gradient averaged over B_small samples and |G_big|^2 that of
one averaged over B_big samples, both unbiased estimates of the true gradient G,

    |G|^2    ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)

are unbiased, and the simple noise scale is B_simple = tr(Sigma) / |G|^2. Each step's ratio is
very noisy (the |G|^2 estimate may even be negative), so, as the paper advises, the numerator and
the denominator are smoothed separately (exponential moving averages) and divided afterwards.
Both averages start at zero with the same decay, so their start-up bias cancels in the ratio.

In the engine, a rank's local gradient (before the reduction) is the small-batch estimate and the
averaged gradient (after it) the big-batch one: B_big / B_small = world size. The reducer takes the
local squared norm where it has just written the gradient (per large tensor after its
copy-and-divide, per small bucket after its division) and the averaged one after the wait
(both in reducer.py), unless the loop takes that one itself (`NoiseScaleObserver.wants_reduced_norm`
off). `NoiseScaleObserver` asks the reducer for those norms through the observer seam
(observers.py) and keeps the estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dpscale.engine.observers import GradNorms, GradNormTensors, StepObserver
from dpscale.engine.stats import StepStats


def bucket_sq_norm(buffer: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm of a contiguous gradient buffer or view, accumulated in float32 at least
    (a 0-d tensor: no host sync on an accelerator until someone reads it)."""
    flat = buffer.view(-1)
    flat = flat if flat.dtype in (torch.float32, torch.float64) else flat.float()
    return torch.dot(flat, flat)


@dataclass
class NoiseScaleEstimate:
    """The smoothed estimates after the last update (units: samples when batches were given in samples)."""

    grad_sq: float  # |G|^2, the squared norm of the true gradient
    trace_sigma: float  # tr(Sigma), the per-sample gradient variance summed over parameters
    b_simple: float | None  # tr(Sigma) / |G|^2; None while the smoothed |G|^2 is not positive
    run_b_simple: float | None  # the same from sums over every step (see run_b_simple)
    updates: int


class NoiseScaleEstimator:
    """Unbiased per-step estimates of |G|^2 and tr(Sigma), each smoothed by an EMA.

    `ema_decay` (0.95): weight of the past in each average; 0 keeps only the last step. Larger is
    steadier and slower to follow a noise scale that changes with training.
    """

    def __init__(self, *, ema_decay: float = 0.95):
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {ema_decay}")
        self.ema_decay = ema_decay
        self._grad_sq = 0.0
        self._trace = 0.0
        # whole-run sums: the steadiest estimate when the noise scale does not change much
        self._grad_sq_sum = 0.0
        self._trace_sum = 0.0
        self.updates = 0

    def update(self, *, small_sq: float, big_sq: float, b_small: float, b_big: float) -> None:
        """One step: |G_small|^2 over `b_small` samples and |G_big|^2 over `b_big` > `b_small`."""
        if not b_big > b_small > 0:
            raise ValueError(f"need b_big > b_small > 0, got b_small={b_small}, b_big={b_big}")
        if not (math.isfinite(small_sq) and math.isfinite(big_sq)):
            return  # a skipped (non-finite) step says nothing about the noise
        grad_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
        trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
        d = self.ema_decay
        self._grad_sq = d * self._grad_sq + (1 - d) * grad_sq
        self._trace = d * self._trace + (1 - d) * trace
        self._grad_sq_sum += grad_sq
        self._trace_sum += trace
        self.updates += 1

    @property
    def b_simple(self) -> float | None:
        if self.updates == 0 or self._grad_sq <= 0:
            return None
        return self._trace / self._grad_sq

    @property
    def run_b_simple(self) -> float | None:
        """B_simple from every step so far weighted alike (sums of numerator and denominator)."""
        if self.updates == 0 or self._grad_sq_sum <= 0:
            return None
        return self._trace_sum / self._grad_sq_sum

    def estimate(self) -> NoiseScaleEstimate | None:
        if self.updates == 0:
            return None
        # undo the start-up bias for the reported parts (the ratio needs no correction)
        correction = 1.0 - self.ema_decay**self.updates
        return NoiseScaleEstimate(
            grad_sq=self._grad_sq / correction,
            trace_sigma=self._trace / correction,
            b_simple=self.b_simple,
            run_b_simple=self.run_b_simple,
            updates=self.updates,
        )

    def state_dict(self) -> dict:
        return {k: getattr(self, "_" + k) for k in ("grad_sq", "trace", "grad_sq_sum", "trace_sum")} | {
            "updates": self.updates
        }

    def load_state_dict(self, state: dict) -> None:
        for k in ("grad_sq", "trace", "grad_sq_sum", "trace_sum"):
            setattr(self, "_" + k, float(state[k]))
        self.updates = int(state["updates"])


class NoiseScaleObserver(StepObserver):
    """The engine's own noise-scale estimate, as a step observer: on every `every`-th synced step
    the reducer takes this rank's gradient norm and (with `reduced_norm`) the averaged one, and
    each such pair updates `estimator`; the step's `StepStats.gradient_noise_scale` is then this
    rank's smoothed B_simple (units of one rank's batch: B_big / B_small = world size).

    `every` (8): measure on every this many synced steps (benchmarks/noise_scale_cost.py has the
    cost). `reduced_norm` (True): take the averaged gradient's norm after the reduction (a second
    read of every gradient). A loop that takes the norm of the reduced gradients anyway (dpscale's
    Trainer, for its skip check and clipping) turns it off and pairs that norm with
    `grad_sq_norm_local`: the step then costs one read of each gradient, while it is still in cache.
    """

    def __init__(
        self, *, every: int = 8, reduced_norm: bool = True, estimator: NoiseScaleEstimator | None = None
    ):
        if every < 1:
            raise ValueError(f"every must be >= 1 (measure on every this many synced steps), got {every}")
        self.every = every
        self.wants_reduced_norm = reduced_norm
        self.estimator = estimator if estimator is not None else NoiseScaleEstimator()
        self._device_norms: tuple[int, GradNormTensors] | None = None

    def device_norms(self, step: int) -> GradNormTensors | None:
        """Synced step `step`'s norms (counting it, as `StepStats.step`) while still on the
        device, for a loop that reduces them in its own collective; None if not measured."""
        kept = self._device_norms
        return kept[1] if kept is not None and kept[0] == step else None

    def on_grad_norms(self, step: int, norms: GradNormTensors) -> None:
        if self.wants_grad_norms(step - 1):
            self._device_norms = (step, norms)

    def wants_grad_norms(self, step: int) -> bool:
        # every rank counts the same synced steps, so all measure on the same ones
        return step % self.every == 0

    def on_step(self, stats: StepStats, norms: GradNorms | None) -> None:
        # the reducer measures when any observer asks (stats.step counts this step already): take
        # only the steps this one asked for, so another observer's wishes do not change `every`
        if norms is None or not self.wants_grad_norms(stats.step - 1):
            return
        # the rank's own estimate needs the averaged norm, and not while ranks have joined (the
        # average is then over fewer ranks)
        if norms.reduced_sq is not None and norms.all_ranks:
            self.estimator.update(
                small_sq=norms.local_sq, big_sq=norms.reduced_sq, b_small=1, b_big=norms.world_size
            )
        stats.gradient_noise_scale = self.estimator.b_simple
