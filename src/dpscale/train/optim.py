"""Optimizer and learning-rate schedule from a `TrainConfig`.

Linear scaling with gradual warm-up follows Goyal et al., "Accurate, Large Minibatch SGD:
Training ImageNet in 1 Hour" (2017): multiply the reference learning rate by
global_batch / reference_batch, and ramp up to it linearly over the first steps because the
scaled rate is unstable while the weights still change fast.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .config import TrainConfig


def build_optimizer(cfg: TrainConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """Multiplier on cfg.lr for the optimizer step with index `step` (0-based)."""
    scale = cfg.global_batch / cfg.lr_reference_batch if cfg.lr_reference_batch else 1.0
    if cfg.warmup_steps and step < cfg.warmup_steps:
        # Goyal et al. ramp from the reference rate to the scaled one; with no scaling the
        # usual warm-up from zero. (step + 1) so the first step does not waste a zero rate.
        start = 1.0 if cfg.lr_reference_batch else 0.0
        frac = (step + 1) / cfg.warmup_steps
        return start + (scale - start) * frac
    return scale


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(cfg, step))
