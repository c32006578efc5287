"""Tasks written as a user would, for `--task user_tasks:NAME` (run from this directory) and
`Trainer(config, task)`; some break the contract on purpose."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset


class TwoInputs(nn.Module):
    """model(a, b) or model(a=..., b=...): a tuple or a dict input."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(2, 3)

    def forward(self, a, b):
        return self.a(a) + self.b(b)


class DictData(Dataset):
    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.a, self.b = torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"a": self.a[i], "b": self.b[i]}, self.y[i]


class TupleData(DictData):
    def __getitem__(self, i):
        return (self.a[i], self.b[i]), self.y[i]


def ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


def correct(out, y):
    return (out.argmax(1) == y).float()


def _task(**kw):
    import dpscale

    base = dict(model=TwoInputs, train_data=DictData(64), eval_data=DictData(7, seed=1), loss=ce)
    return dpscale.Task(**{**base, **kw})


def dict_task():
    return _task(metrics={"accuracy": correct})


def tuple_task():
    def collate(items):  # the user's own collate: ((a, b), y) from a list of items
        a = torch.stack([x[0] for x, _ in items])
        b = torch.stack([x[1] for x, _ in items])
        return (a, b), torch.stack([t for _, t in items])

    return _task(train_data=TupleData(64), eval_data=TupleData(7, seed=1), collate_fn=collate)


def tensor_task():
    import dpscale

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = (x[:, 0] > 0).long()
    return dpscale.Task(
        model=lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)),
        train_data=TensorDataset(x[:192], y[:192]),
        eval_data=TensorDataset(x[192:], y[192:]),
        loss=ce,
        metrics={"accuracy": correct},
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
    )


def scalar_loss():
    return _task(loss=lambda out, y: F.cross_entropy(out, y))


def bad_metric():
    return _task(metrics={"accuracy": lambda out, y: correct(out, y).mean()})


def model_raises():
    def broken():
        raise RuntimeError("no such layer size")

    return _task(model=broken)


def model_not_module():
    return _task(model=lambda: "a string")


def not_a_task():
    return TwoInputs()


def tiny_data():
    return _task(train_data=DictData(10))


def factory_raises():
    raise FileNotFoundError("data.csv")


class RaisesInForward(TwoInputs):
    def forward(self, a, b):
        raise KeyError("no such head")


class ReturnsText(TwoInputs):
    def forward(self, a, b):
        return "logits"


class NoParameters(nn.Module):
    def forward(self, a, b):
        return torch.zeros(a.shape[0], 3) + a.sum(1, keepdim=True) * 0


def forward_raises():
    return _task(model=RaisesInForward)


def forward_returns_str():
    return _task(model=ReturnsText)


def no_parameters():
    return _task(model=NoParameters)


def exits_in_make():
    import sys

    sys.exit(0)
