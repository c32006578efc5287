"""Resume planning: pure functions from a checkpoint's `TrainState` and this run's setup to what changes.

No process group, no files: the trainer applies the plan (trainer.py), the checkpoint manager moves
the bytes (checkpointer.py), and these rules are tested on their own (tests/train/test_resume_plan.py).

The sampler position is counted in global batches, so a checkpoint resumes at any world size. By
default (world_change=keep-global-batch) the global batch is kept (the optimization is the same)
and so is the saved micro-batch (what fits a worker's memory); the accumulation steps change. At
the same world size the saved split is kept too, unless the configuration names one. With
world_change=scale-lr each worker's batch is kept instead: the global batch follows the world size,
the sampler goes on from the next unused sample, the LR moves by the linear rule over a ramp, and
the sample budget (epochs, or max_steps x the configured batch) is kept. A run whose batch grew
(--global-batch auto) goes on at the grown batch, also at another world size where it splits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from dpscale.errors import ConfigError
from dpscale.train.adaptive.auto_batch import MAX_GROWTH
from dpscale.train.checkpoint.files import CheckpointError
from dpscale.train.config import TrainConfig
from dpscale.train.optim import BatchScale, lr_factor
from dpscale.train.state import TrainState


@dataclass(frozen=True)
class BatchSplit:
    micro_batch: int
    accumulation_steps: int


class SamplerPosition(Protocol):
    """What the step budget needs of a `GlobalBatchSampler`."""

    @property
    def epoch(self) -> int: ...
    @property
    def step_in_epoch(self) -> int: ...
    @property
    def steps_this_epoch(self) -> int: ...
    @property
    def steps_per_epoch(self) -> int: ...


def check_resumable(
    saved: TrainState, *, global_batch: int, world_change: str, where: Path | str, auto_batch: bool = False
) -> None:
    """ValueError naming the setting to change when this run cannot continue `saved`."""
    if saved.base_global_batch != global_batch:
        raise ConfigError(
            f"checkpoint {where} was trained with global_batch {saved.base_global_batch}, this run "
            f"asks for {global_batch}; use the same global batch to resume"
        )
    if saved.global_batch == global_batch:
        return
    if auto_batch:
        grown = saved.global_batch // global_batch
        if saved.global_batch % global_batch or grown & (grown - 1) or grown > MAX_GROWTH:
            raise CheckpointError(
                f"checkpoint {where}: global batch {saved.global_batch} is not the start batch "
                f"{global_batch} times a power of two up to {MAX_GROWTH}, as --global-batch auto grows "
                "it; the file is corrupt"
            )
        return
    if saved.batch_growth:
        raise ConfigError(
            f"checkpoint {where} had grown to global batch {saved.global_batch} under global_batch "
            "auto; resume with --global-batch auto"
        )
    if world_change != "scale-lr":
        raise ConfigError(
            f"checkpoint {where} had moved to global batch {saved.global_batch} under "
            f"world_change=scale-lr; resume with world_change=scale-lr (--world-change scale-lr)"
        )


def plan_split(
    saved: TrainState,
    *,
    world_size: int,
    current: BatchSplit,
    global_batch: int,
    configured_global_batch: int,
    world_change: str,
    split_given: bool,
    where: Path | str,
    auto_batch: bool = False,
) -> BatchSplit:
    """The batch split for `world_size` when resuming `saved`; `current` is the one made from the
    configuration (over `global_batch` samples) for this world size, `split_given` whether the
    configuration named it (micro_batch or accumulation_steps) rather than took the default. With
    `auto_batch` the run goes on at the batch it had grown to, split as keep-global-batch splits it;
    where that batch does not split over this world size, at `current` (the start batch)."""
    old_micro, old_k = saved.micro_batch, saved.accumulation_steps
    # None in checkpoints written before the split was saved
    old = None
    if isinstance(old_micro, int) and isinstance(old_k, int) and old_micro > 0 and old_k > 0:
        old = BatchSplit(old_micro, old_k)
    if saved.world_size == world_size and saved.global_batch == global_batch:
        # the run goes on as it was unless told otherwise: the default split (one micro-batch of
        # G/W) would change the memory a worker needs and the order the gradients are summed in
        if (
            split_given
            or old is None
            or old.micro_batch * old.accumulation_steps * world_size != global_batch
        ):
            return current
        return old
    if auto_batch:
        global_batch = saved.global_batch
    if world_change == "scale-lr":
        # a worker's batch is the configured global batch over the first world size, never more
        per_worker = old.micro_batch * old.accumulation_steps if old is not None else 0
        if (
            old is None
            or per_worker * saved.world_size != saved.global_batch
            or (per_worker > configured_global_batch)
        ):
            raise CheckpointError(
                f"checkpoint {where}: micro_batch {old_micro!r} x accumulation_steps {old_k!r} x "
                f"world_size {saved.world_size} is not its global batch {saved.global_batch}, or a worker's "
                f"batch exceeds the configured global batch {configured_global_batch}; the file is corrupt"
            )
        return old
    if old is not None and global_batch % (world_size * old.micro_batch) == 0:
        return BatchSplit(old.micro_batch, global_batch // (world_size * old.micro_batch))
    return current  # the split resolve_batch made from the configuration for this world size


def plan_total_steps(
    state: TrainState, *, max_steps: int | None, epochs: int | None, sampler: SamplerPosition
) -> int:
    """The step at which training ends, from the configuration and the current position.

    With the configured global batch this is max_steps, or epochs x steps per epoch. After the
    global batch changed (world_change=scale-lr, --global-batch auto), even if it changed back, the
    budget is kept in samples: the epochs, or
    max_steps x the configured global batch, whatever batch the remaining steps use.
    """
    if max_steps is not None:
        # a run that ever changed its batch (even back to the configured one) counts samples
        changed = state.batch_changed or state.global_batch != state.base_global_batch
        if not changed and state.batch_scale == BatchScale():
            return max_steps
        left = max(0, max_steps * state.base_global_batch - state.samples_seen)
        return state.step + -(-left // state.global_batch)
    assert epochs is not None, "TrainConfig sets epochs when max_steps is unset"
    s = sampler
    if s.epoch >= epochs:  # the last epoch is over (a regroup at its end moved past it)
        return state.step
    left_this_epoch = s.steps_this_epoch - s.step_in_epoch
    return state.step + left_this_epoch + (epochs - 1 - s.epoch) * s.steps_per_epoch


def describe_resplit(
    saved: TrainState,
    now: TrainState,
    cfg: TrainConfig,
    scheduler_step: int,
    base_lr: float,
    total_steps: int,
) -> str:
    """The line rank 0 logs when a checkpoint written by another number of workers is resumed."""
    old_micro, old_k, old_g = saved.micro_batch, saved.accumulation_steps, saved.global_batch
    if now.global_batch == old_g:
        how = (
            f"global batch {old_g} kept; micro-batch {old_micro} -> {now.micro_batch}, accumulation "
            f"steps {old_k} -> {now.accumulation_steps}; results match the uninterrupted run up to "
            "floating-point summation order"
        )
    else:
        s, c = now.batch_scale, scheduler_step
        lr_from = base_lr * lr_factor(cfg, c) * s.start
        lr_to = base_lr * lr_factor(cfg, c + s.steps) * s.target
        how = (
            f"per-worker batch {old_micro} x {old_k} kept; global batch {old_g} -> {now.global_batch}; "
            f"learning rate x{s.target / s.start:.4g} by the linear scaling rule ({lr_from:.4g} -> "
            f"{lr_to:.4g} over {s.steps} steps); the run ends at step {total_steps} to keep its "
            "sample budget"
        )
    return f"checkpoint written by {saved.world_size} workers, resuming with {now.world_size}: {how}"
