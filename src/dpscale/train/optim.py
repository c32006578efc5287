"""Optimizer and learning-rate schedule from a `TrainConfig`.

Linear scaling with gradual warm-up follows Goyal et al., "Accurate, Large Minibatch SGD:
Training ImageNet in 1 Hour" (2017): multiply the reference learning rate by
global_batch / reference_batch, and ramp up to it linearly over the first steps because the
scaled rate is unstable while the weights still change fast.

With `world_change=scale-lr` the global batch follows the world size after an elastic restart, and
the same linear rule moves the rate by G_now / G_configured, ramped from the rate in use at the
restart (`BatchScale`). The ramp lives in the trainer's checkpoint, so a resume mid-ramp goes on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch

from dpscale.errors import ConfigError
from dpscale.train.config import TrainConfig


def build_optimizer(cfg: TrainConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    assert cfg.optim.lr is not None, "TrainConfig fills lr in"
    if cfg.optim.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.optim.lr, momentum=cfg.optim.momentum, weight_decay=cfg.optim.weight_decay
        )
    if cfg.optim.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """Multiplier on cfg.optim.lr for the optimizer step with index `step` (0-based)."""
    assert cfg.data.global_batch is not None, "TrainConfig fills global_batch in"
    scale = cfg.data.global_batch / cfg.optim.lr_reference_batch if cfg.optim.lr_reference_batch else 1.0
    if cfg.optim.warmup_steps and step < cfg.optim.warmup_steps:
        # Goyal et al. ramp from the reference rate to the scaled one; with no scaling the
        # usual warm-up from zero. (step + 1) so the first step does not waste a zero rate.
        start = 1.0 if cfg.optim.lr_reference_batch else 0.0
        frac = (step + 1) / cfg.optim.warmup_steps
        return start + (scale - start) * frac
    return scale


@dataclass
class BatchScale:
    """Extra LR multiplier G_now / G_configured, reached linearly from `start` over `steps` steps.

    Steps are the scheduler's (optimizer steps taken, skipped ones not counted): from step
    `from_step` on, the multiplier is start + (target - start) * min(1, (step - from_step + 1) / steps).
    """

    target: float = 1.0
    start: float = 1.0
    from_step: int = 0
    steps: int = 0

    def __call__(self, step: int) -> float:
        if self.steps == 0 or step - self.from_step + 1 >= self.steps:
            return self.target
        frac = max(0, step - self.from_step + 1) / self.steps
        return self.start + (self.target - self.start) * frac

    def retarget(self, target: float, at_step: int, steps: int) -> None:
        """Ramp from the multiplier in force at `at_step` to `target` (a world-size change)."""
        self.start, self.target, self.from_step, self.steps = self(at_step), target, at_step, steps

    def to_dict(self) -> dict:
        return asdict(self)

    def state_dict(self) -> dict:
        return self.to_dict()

    def load_state_dict(self, state: object) -> None:
        """In place (the scheduler's lambda holds this object); ValueError for a malformed state."""
        vars(self).update(vars(BatchScale.from_dict(state)))

    @classmethod
    def from_dict(cls, d: object) -> BatchScale:
        if not isinstance(d, dict) or set(d) != {"target", "start", "from_step", "steps"}:
            raise ConfigError(f"batch scale {d!r} is not a dict with target, start, from_step, steps")
        multipliers, steps = (d["target"], d["start"]), (d["from_step"], d["steps"])
        if not (
            all(type(m) in (int, float) and 0 < m < math.inf for m in multipliers)
            and all(type(s) is int and s >= 0 for s in steps)
        ):
            raise ConfigError(f"batch scale {d!r}: multipliers must be finite and > 0, steps counts")
        return cls(float(d["target"]), float(d["start"]), d["from_step"], d["steps"])


def build_scheduler(
    cfg: TrainConfig, optimizer: torch.optim.Optimizer, batch_scale: BatchScale | None = None
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over lr_factor, times `batch_scale` (read at every step, so it may change later)."""
    scale = batch_scale or BatchScale()
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(cfg, step) * scale(step))


def sync_lr(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Set the optimizer's rates to what the schedule says for the next step (after a resume)."""
    for group, base, fn in zip(
        scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
    ):
        group["lr"] = base * fn(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]  # get_last_lr()
