"""The bare model the profile and the sync probe step: no engine, the same weights and batch per rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BareModel:
    workload: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    x: torch.Tensor
    y: torch.Tensor

    def step(self) -> None:
        """One training step: zero_grad, forward, mean loss, backward, optimizer step."""
        self.optimizer.zero_grad(set_to_none=True)
        (self.workload.loss_sum(self.model(self.x), self.y) / self.x.shape[0]).backward()
        self.optimizer.step()


def bare_model(model_name: str, batch: int, rank: int) -> BareModel:
    """Built-in workload `model_name` with seed-0 weights and a fixed batch drawn for `rank`."""
    from ..workloads import get_workload

    workload = get_workload(model_name)
    train, _ = workload.build_data(0)
    g = torch.Generator().manual_seed(100 + rank)
    x, y = train.batch(torch.randint(0, len(train), (batch,), generator=g).tolist())
    torch.manual_seed(0)
    model = workload.build_model()
    # a small lr keeps weights finite over the run; the update costs the same whatever the lr
    return BareModel(workload, model, torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9), x, y)
