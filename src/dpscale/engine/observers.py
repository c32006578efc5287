"""The observer seam: each synced step's measurements, delivered to whoever asked for them.

The reducer measures what every step needs anyway (when each bucket's reduction ran: `StepStats`)
and, on the steps an observer asks for, the squared gradient norms the noise scale needs
(`GradNorms`). What is made of them (the noise scale, telemetry, a user's logger) lives in the
observers, not in the reducer: `DistributedDataParallel.add_step_observer(observer)`. Every
engine has one: torch's logging data (compat/ddp_logging.py), which asks for no norms; an
observer that asks for none costs one call per step.

Nothing here waits for the device: on a GPU a step's stats and norms reach `on_step` once its
events have completed (clock.py), a step or more later; `on_grad_norms` gets the norms at once,
as device tensors, for a loop that folds them into a collective of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dpscale.engine.stats import StepStats


@dataclass(frozen=True)
class GradNorms:
    """Squared gradient norms of one synced step, over the dense buckets.

    `local_sq`: this rank's gradient before the reduction, as its own average (units of one
    rank's batch); `reduced_sq`: the averaged gradient after it, None unless some observer asked
    for it (`wants_reduced_norm`). `all_ranks`: the average is over every rank (False while
    ranks have joined, see compat/join.py); `world_size`: the ranks of the group.
    """

    local_sq: float
    reduced_sq: float | None
    world_size: int
    all_ranks: bool


@dataclass(frozen=True)
class GradNormTensors:
    """`GradNorms` before they reach the host: 0-d float64 tensors on the gradients' device."""

    local_sq: torch.Tensor
    reduced_sq: torch.Tensor | None
    world_size: int
    all_ranks: bool


class StepObserver:
    """What the engine calls around each synced step; override what you need.

    `wants_grad_norms(step)` is asked before each synced backward (`step`: synced steps done
    so far, the same on every rank); when one observer says yes (and the group has more than one
    rank), the reducer takes this rank's gradient norm during backward, and the averaged one after
    it if one observer has `wants_reduced_norm`. `on_step(stats, norms)` runs once the step's
    measurements can be read without waiting for the device (on CPU: after every reduction is
    over; on CUDA: at a later step), in the order observers were added, steps in order; `norms`
    is None on unmeasured steps. `on_grad_norms(step, norms)` runs right after the reduction on
    measured steps, with the norms still on the device (`step` counts this one, as
    `StepStats.step` does).
    """

    wants_reduced_norm: bool = False

    def wants_grad_norms(self, step: int) -> bool:
        return False

    def on_grad_norms(self, step: int, norms: GradNormTensors) -> None:
        pass

    def on_step(self, stats: StepStats, norms: GradNorms | None) -> None:
        pass
