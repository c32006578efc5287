"""A task as the lab steps it: a model, one random batch at a time, the loss summed over samples.

The lab (scaling bench, profile, checks) times or compares single steps on batches it draws
itself, so it needs less than the trainer: `make_batch(n, generator)` collates n random items of
the task's train_data, `forward` calls the model with the input's kind (tensor, tuple or dict),
and `loss` sums the task's per-sample losses, so dividing by n gives the mean whatever the split.
Every command that takes a model reads the same `module:callable` returning a `dpscale.Task`
(see load.py), so a spec means one thing everywhere. Specs are strings so they travel to
spawned ranks, where each loads its own copy.
"""

from __future__ import annotations

from collections.abc import Sized
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from dpscale.workloads.load import TASK_CONVENTION, is_task_spec, load_task
from dpscale.workloads.task import Task, call_model, per_sample, probe

__all__ = ["TASK_CONVENTION", "Recipe", "is_task_spec", "load_recipe"]


@dataclass(frozen=True)
class Recipe:
    task: Task

    def build_model(self) -> nn.Module:
        return self.task.model()

    def make_batch(self, batch: int, g: torch.Generator) -> tuple[Any, Any]:
        """`batch` items of train_data drawn with replacement by `g`, collated as the trainer does."""
        data = self.task.train_data
        return self.task.collate(
            [data[i] for i in torch.randint(0, len(cast(Sized, data)), (batch,), generator=g).tolist()]
        )

    def take(self, x: Any, y: Any, part: slice) -> tuple[Any, Any]:
        """Samples `part` of a collated batch (a worker's share, a micro-batch)."""
        return _slice(x, part), _slice(y, part)

    @staticmethod
    def forward(model: nn.Module, x: Any) -> Any:
        return call_model(model, x)

    def loss(self, output: Any, target: Any) -> torch.Tensor:
        """The task's per-sample losses, summed."""
        assert self.task.loss is not None  # Task.__post_init__ requires a callable loss
        return per_sample("Task.loss", self.task.loss(output, target), _count(target, output)).sum()


def _slice(value: Any, part: slice) -> Any:
    if isinstance(value, torch.Tensor):
        return value[part]
    if isinstance(value, dict):
        return {k: _slice(v, part) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_slice(v, part) for v in value)
    return value


def _count(target: Any, output: Any) -> int:
    """Samples in a batch: dim 0 of the target (or the output when the target is not a tensor)."""
    t = target if isinstance(target, torch.Tensor) else output
    return int(t.shape[0]) if isinstance(t, torch.Tensor) and t.dim() else 1


def load_recipe(spec: str, flag: str = "--model", *, check: bool = False) -> Recipe:
    """The recipe of `spec`; with `check`, its task is probed first (a broken one: one ValueError,
    before any rank starts)."""
    recipe = Recipe(load_task(spec, flag=flag))
    if check:
        probe(recipe.task)
    return recipe
