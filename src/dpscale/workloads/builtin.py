"""Built-in workloads by name: each a `Task` (model, data, per-sample loss, metrics) plus the
defaults the CLI uses when the user names none.

The loss gives one value per sample (for the transformer: the mean over a sequence's tokens). The
training loop divides their sum by the number of samples in the whole global batch, so gradients
equal the full-batch mean whatever the split.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from dpscale.errors import ConfigError
from dpscale.workloads import datasets, models
from dpscale.workloads.task import Task


@dataclass(frozen=True)
class Workload:
    name: str
    build_model: Callable[[], nn.Module]
    build_data: Callable[[int], tuple[datasets.TensorData, datasets.TensorData | None]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # per sample, shape [batch]
    # defaults the CLI uses when the user names none
    global_batch: int
    lr: float
    epochs: int
    optimizer: str = "sgd"
    metrics: Mapping[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = field(default_factory=dict)

    def task(self, seed: int = 0) -> Task:
        """The workload as a Task; `seed` fixes generated data and the train/test split."""
        train, test = self.build_data(seed)
        return Task(self.build_model, train, test, loss=self.loss, metrics=self.metrics)

    def loss_sum(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The per-sample losses summed (what the lab's hand-written loops divide by their batch)."""
        return self.loss(output, target).sum()


def _ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, y, reduction="none")


def _accuracy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (logits.argmax(dim=-1) == y).float()


def _token_ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    per_token = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
    return per_token.view(y.shape).mean(dim=1)


_CLASSIFICATION = {"accuracy": _accuracy}


def _mlp_data(seed: int):
    return datasets.synthetic_classification(4096, 1024, 10, seed=seed), None


def _synthetic_data(seed: int):
    data = datasets.synthetic_classification(10_240, 64, 10, seed=seed)
    cut = 8192
    return (datasets.TensorData(data.x[:cut], data.y[:cut]), datasets.TensorData(data.x[cut:], data.y[cut:]))


def _tokens(seed: int):
    return datasets.synthetic_tokens(2048, 64, seed=seed), None


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload(
            "digits",
            models.DigitsNet,
            lambda seed: datasets.digits(seed),
            _ce,
            global_batch=64,
            lr=0.1,
            epochs=15,
            metrics=_CLASSIFICATION,
        ),
        Workload(
            "synthetic",
            models.DigitsNet,
            _synthetic_data,
            _ce,
            global_batch=128,
            lr=0.1,
            epochs=3,
            metrics=_CLASSIFICATION,
        ),
        Workload("mlp", models.mlp, _mlp_data, _ce, global_batch=128, lr=0.01, epochs=1),
        Workload(
            "transformer",
            models.transformer,
            _tokens,
            _token_ce,
            global_batch=32,
            lr=1e-3,
            epochs=1,
            optimizer="adamw",
        ),
    ]
}


def get_workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ConfigError(f"unknown workload {name!r}; choose one of: {', '.join(WORKLOADS)}") from None
