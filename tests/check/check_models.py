"""User models for the check tests, loaded by `module:callable` specs (this folder is on sys.path)."""

import torch
from torch import nn


def _batch(n, g):
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def mean_loss():
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)), _batch, nn.functional.cross_entropy


def sum_loss():
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    return model, _batch, lambda out, y: nn.functional.cross_entropy(out, y, reduction="sum")


class Alternating(nn.Module):
    """`extra` is used every other step; `never` is never used."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 3)
        self.extra = nn.Linear(3, 3)
        self.never = nn.Linear(3, 3)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.body(x)
        return self.extra(h) if self.calls % 2 else h


def alternating():
    return Alternating(), _batch, nn.functional.cross_entropy


def never_used():
    model = Alternating()
    model.forward = lambda x: model.extra(model.body(x))
    return model, _batch, nn.functional.cross_entropy
