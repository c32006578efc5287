"""A task module in the style of a training script: its data drawn with torch's global RNG at import.

Every rank imports it afresh, so the data agrees across ranks only because dpscale seeds torch
before importing a task's module (workloads/load.py). Imported by no test: only by its spec.
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpscale

X, Y = torch.randn(64, 6), torch.randint(0, 3, (64,))


def make():
    return dpscale.Task(
        model=lambda: nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)),
        train_data=TensorDataset(X, Y),
        loss=lambda out, y: nn.functional.cross_entropy(out, y, reduction="none"),
    )
