"""A model to measure or check: a built-in workload's, or the user's own given as `module:callable`.

The callable takes no arguments and returns either an nn.Module, fed float inputs of shape
(batch, in_features of its first nn.Linear) and trained to output zeros (loss: sum of squared
outputs), or a tuple (model, make_batch(batch_size, generator) -> (x, y), loss(output, y)).
Specs are strings so they travel to spawned ranks, where `load_recipe` resolves them.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .registry import WORKLOADS, get_workload

USER_MODEL_CONVENTION = (
    "`module:callable`: the callable takes no arguments and returns either an nn.Module fed float "
    "inputs of shape (batch, in_features of its first nn.Linear), trained to output zeros (loss: sum "
    "of squared outputs), or a tuple (model, make_batch(batch_size, generator) -> (x, y), "
    "loss(output, y) -> scalar)"
)
USER_MODEL_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass(frozen=True)
class Recipe:
    build_model: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # built-ins: summed over samples


def is_model_spec(spec: str) -> bool:
    return spec in WORKLOADS or bool(USER_MODEL_RE.match(spec))


def load_recipe(spec: str, flag: str = "--model") -> Recipe:
    if spec in WORKLOADS:
        w = get_workload(spec)
        train, _ = w.build_data(0)

        def make_batch(batch: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            return train.batch(torch.randint(0, len(train), (batch,), generator=g).tolist())

        return Recipe(w.build_model, make_batch, w.loss_sum)
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"{flag}: cannot load {spec!r} ({e}); expected {USER_MODEL_CONVENTION}") from None
    if not callable(factory):
        raise ValueError(f"{flag}: {spec} is not callable; expected {USER_MODEL_CONVENTION}")
    made = factory()
    if isinstance(made, tuple) and len(made) == 3 and isinstance(made[0], nn.Module):
        return Recipe(lambda: factory()[0], made[1], made[2])
    if not isinstance(made, nn.Module):
        raise ValueError(f"{flag}: {spec} returned {type(made).__name__}; expected {USER_MODEL_CONVENTION}")
    first = next((m for m in made.modules() if isinstance(m, nn.Linear)), None)
    if first is None:
        raise ValueError(f"{flag}: {spec} has no nn.Linear to size inputs by; return the tuple form")
    in_features = first.in_features

    def random_batch(batch: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch, in_features, generator=g), torch.empty(0)

    return Recipe(factory, random_batch, lambda out, _y: out.float().square().sum())
