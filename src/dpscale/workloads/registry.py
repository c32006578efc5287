"""Built-in workloads by name: a model, its data and a per-sample loss, plus sensible defaults.

The loss returns the *sum* over the samples it is given (for the transformer: the per-sample
mean over tokens, summed over samples). The training loop divides by the number of samples in
the whole global batch, so gradients equal the full-batch mean whatever the split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from . import datasets, models


@dataclass(frozen=True)
class Workload:
    name: str
    build_model: Callable[[], nn.Module]
    build_data: Callable[[int], tuple[datasets.TensorData, datasets.TensorData | None]]
    loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # defaults the CLI uses when the user names none
    global_batch: int
    lr: float
    epochs: int
    optimizer: str = "sgd"


def _ce_sum(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, y, reduction="sum")


def _token_ce_sum(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    per_token = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
    return per_token.view(y.shape).mean(dim=1).sum()


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
            _ce_sum,
            global_batch=64,
            lr=0.1,
            epochs=15,
        ),
        Workload("synthetic", models.DigitsNet, _synthetic_data, _ce_sum, global_batch=128, lr=0.1, epochs=3),
        Workload("mlp", models.mlp, _mlp_data, _ce_sum, global_batch=128, lr=0.01, epochs=1),
        Workload(
            "transformer",
            models.transformer,
            _tokens,
            _token_ce_sum,
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
        raise ValueError(f"unknown workload {name!r}; choose one of: {', '.join(WORKLOADS)}") from None
