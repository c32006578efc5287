"""Your own model and data for `dpscale train`: a small CNN that tells stripes from checkerboards.

    dpscale train --task own_task:make --nproc 2 --json        # run from this directory
    dpscale check equivalence --model own_task:make             # W workers == one big batch?
    dpscale bench scaling --model own_task:make --nproc 1,2

The images are generated (no download): 16x16 single-channel pictures of horizontal stripes,
vertical stripes or a checkerboard, at a random phase, with noise. dpscale seeds torch before
calling `make`, so every worker generates the same images.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import dpscale

SIZE = 16
CLASSES = 3  # horizontal stripes, vertical stripes, checkerboard


def pictures(n: int) -> TensorDataset:
    labels = torch.randint(0, CLASSES, (n,))
    period = torch.randint(2, 5, (n, 1, 1)).float()
    phase = torch.rand(n, 1, 1) * 6.28
    rows = torch.arange(SIZE).view(1, SIZE, 1).float()
    cols = torch.arange(SIZE).view(1, 1, SIZE).float()
    horizontal = torch.sin(rows * 6.28 / period + phase).expand(n, SIZE, SIZE)
    vertical = torch.sin(cols * 6.28 / period + phase).expand(n, SIZE, SIZE)
    checker = horizontal * vertical
    images = torch.stack([horizontal, vertical, checker], dim=1)[torch.arange(n), labels]
    images = images + 0.5 * torch.randn(n, SIZE, SIZE)
    return TensorDataset(images.unsqueeze(1), labels)  # items: (image [1, 16, 16], label)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.head = nn.Linear(32 * 4 * 4, CLASSES)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)  # 16 -> 8
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # 8 -> 4
        return self.head(x.flatten(1))


def accuracy(logits, labels):
    return (logits.argmax(dim=1) == labels).float()  # one value per image


def make() -> dpscale.Task:
    return dpscale.Task(
        model=SmallCNN,
        train_data=pictures(4096),
        eval_data=pictures(512),
        loss=lambda logits, labels: F.cross_entropy(logits, labels, reduction="none"),
        metrics={"accuracy": accuracy},
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
    )
