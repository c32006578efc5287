"""Growing the global batch with the gradient noise scale (`--global-batch auto`), workers fixed.

McCandlish et al. 2018: a batch well below the noise scale B_noise wastes steps (each step could
average more samples at little extra cost in samples), one well above it wastes samples. The noise
scale grows as the loss falls, so the best batch grows during training; Pollux (Qiao et al., OSDI
2021) adapts it as the run goes. Here the batch doubles, by doubling the accumulation steps (the
workers and their micro-batch stay), whenever the smoothed noise scale the loop measures has
reached twice the current global batch, up to `max_global_batch`. Each doubling keeps the sampler's
place in the epoch (`Trainer.set_batch_split`, as a world-size change does) and replans the steps
left. Paired with `AdaScaleGain` (adascale.py), the learning rate follows the batch.

Decisions use the noise scale every rank holds alike and the step count, so every rank changes
the batch at the same step. The estimate needs two gradients per step: several workers, or one
worker with at least two micro-batches.
"""

from __future__ import annotations

from .callbacks import TrainerCallback


class GrowBatch(TrainerCallback):
    """Doubles the accumulation steps while the noise scale is at least twice the global batch.

    `check_every`: steps between decisions; `min_updates`: noise-scale measurements needed before
    the first one (an estimate from a handful of steps is mostly noise). `changes` records
    (step, new global batch)."""

    def __init__(self, *, max_global_batch: int, check_every: int = 8, min_updates: int = 8):
        if max_global_batch < 1 or check_every < 1 or min_updates < 1:
            raise ValueError("max_global_batch, check_every and min_updates must be >= 1")
        self.max_global_batch = max_global_batch
        self.check_every = check_every
        self.min_updates = min_updates
        self.changes: list[tuple[int, int]] = []

    def wanted_accumulation(self, *, b_simple: float | None, global_batch: int, accumulation: int) -> int:
        """The accumulation steps to use from now on (the current ones when nothing changes)."""
        grown = accumulation
        while b_simple is not None and b_simple >= 2 * global_batch * grown / accumulation:
            if global_batch * 2 * grown // accumulation > self.max_global_batch:
                break
            grown *= 2
        return grown

    def after_step(self, trainer) -> None:
        if trainer.step % self.check_every or trainer.noise_scale.estimator.updates < self.min_updates:
            return
        state = trainer.state
        accumulation = self.wanted_accumulation(
            b_simple=trainer.noise_scale.b_simple,
            global_batch=state.global_batch,
            accumulation=state.accumulation_steps,
        )
        if accumulation != state.accumulation_steps:
            trainer.set_batch_split(state.micro_batch, accumulation)
            trainer.total_steps = trainer.plan_total_steps()
            self.changes.append((trainer.step, state.global_batch))
