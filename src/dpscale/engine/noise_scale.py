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
(both in reducer.py), unless the loop takes that one itself (`noise_scale_reduced_norm`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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
