"""User tasks for the check tests, loaded by `module:callable` specs (this folder is on sys.path)."""

import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpscale


def _data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))


def _ce(out, y):
    return nn.functional.cross_entropy(out, y, reduction="none")


def _mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def per_sample_loss():
    return dpscale.Task(model=_mlp, train_data=_data(), loss=_ce)


def sum_loss():
    return dpscale.Task(
        model=_mlp,
        train_data=_data(),
        loss=lambda out, y: nn.functional.cross_entropy(out, y, reduction="sum"),
    )


def batch_norm():
    """BatchNorm normalizes by the batch it sees: a worker's share is not the full batch."""
    return dpscale.Task(
        model=lambda: nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3)),
        train_data=_data(),
        loss=_ce,
    )


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
    return dpscale.Task(model=Alternating, train_data=_data(), loss=_ce)


def _never_used_model():
    model = Alternating()
    model.forward = lambda x: model.extra(model.body(x))
    return model


def never_used():
    return dpscale.Task(model=_never_used_model, train_data=_data(), loss=_ce)


class _DictData(torch.utils.data.Dataset):
    def __init__(self):
        self.x, self.y = _data().tensors

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"a": self.x[i, :4], "b": self.x[i, 4:]}, self.y[i]


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(2, 3)

    def forward(self, a, b):
        return self.a(a) + self.b(b)


def dict_inputs():
    """model(**input) on dict items: the lab slices and feeds them as the trainer does."""
    return dpscale.Task(model=_TwoInputs, train_data=_DictData(), loss=_ce)
