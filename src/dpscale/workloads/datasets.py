"""Data for the built-in workloads, all local: generated, or shipped inside an installed package.

`digits` is scikit-learn's bundled copy of the UCI 8x8 handwritten digits (1,797 images), so the
loop is exercised on real data without a download. Everything is returned as CPU tensors; the
train/test split is fixed by the seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from dpscale.errors import import_extra


@dataclass(frozen=True)
class TensorData(Dataset):
    """Inputs and targets: a map-style dataset of (input, target) items, also indexable by a list."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return self.x[idx], self.y[idx]


def digits(seed: int = 0, test_fraction: float = 0.2) -> tuple[TensorData, TensorData]:
    bunch = import_extra("sklearn.datasets", "the digits workload").load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32) / 16.0  # pixel values are 0..16
    y = torch.tensor(bunch.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(x) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return TensorData(x[train], y[train]), TensorData(x[test], y[test])


def synthetic_classification(n: int, features: int, classes: int, seed: int = 0) -> TensorData:
    """Gaussian inputs labelled by a fixed random linear teacher: learnable, so loss falls."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    teacher = torch.randn(features, classes, generator=g)
    return TensorData(x, (x @ teacher).argmax(dim=1))


def synthetic_tokens(n: int, seq_len: int, vocab: int = 256, seed: int = 0) -> TensorData:
    """Token sequences with a learnable rule (next token = previous + 1 mod vocab, from a random start)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    seq = (start + torch.arange(seq_len + 1)) % vocab
    return TensorData(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())
