"""The bare model the profile and the sync probe step: no engine, the same weights and batch per rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class BareModel:
    workload: Any  # a Recipe: forward and loss (dpscale.lab.recipe)
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    x: object  # a tensor, tuple or dict (see dpscale.Task)
    y: object
    batch: int

    def step(self) -> None:
        """One training step: zero_grad, forward, mean loss, backward, optimizer step."""
        self.optimizer.zero_grad(set_to_none=True)
        (self.workload.loss(self.workload.forward(self.model, self.x), self.y) / self.batch).backward()
        self.optimizer.step()


def bare_model(model_name: str, batch: int, rank: int) -> BareModel:
    """Task `model_name` (built-in or module:callable) with seed-0 weights and a fixed batch for `rank`."""
    from dpscale.lab.recipe import load_recipe

    workload = load_recipe(model_name)
    x, y = workload.make_batch(batch, torch.Generator().manual_seed(100 + rank))
    torch.manual_seed(0)
    model = workload.build_model()
    # a small lr keeps weights finite over the run; the update costs the same whatever the lr
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    return BareModel(workload, model, opt, x, y, batch)
