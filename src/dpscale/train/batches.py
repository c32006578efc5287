"""Collated micro-batches for the sampler's steps, through a DataLoader (optionally with workers).

The sampler decides which samples each micro-batch holds and keeps the position checkpoints
save. A DataLoader with workers reads ahead, so it must not advance that position: it iterates a
copy of the sampler, started at the same position, while the trainer advances the real one step
by step. Both yield the same index lists in the same order, so each step's micro-batches pair up.
An empty micro-batch (a short `keep` tail) is loaded as sample 0 and weighted zero by the trainer:
the synchronized backward must run on every rank even with nothing to add.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from dpscale.data.sampler import GlobalBatchSampler

_FORK = "fork" if "fork" in mp.get_all_start_methods() else None


class MicroBatches:
    """`next_step(n)` returns the next n collated micro-batches (one optimizer step's)."""

    def __init__(
        self,
        dataset: Dataset,
        collate,
        *,
        workers: int = 0,
        pin_memory: bool = False,
    ):
        self.dataset = dataset
        self.collate = collate
        self.workers = workers
        self.pin_memory = pin_memory
        self._it: Iterator[Any] | None = None

    def start_segment(self, sampler: GlobalBatchSampler) -> None:
        """Read the micro-batches of the sampler's remaining steps in this epoch from where it is now."""
        self.close()
        ahead = copy.deepcopy(sampler)
        indices = (mb or [0] for step in ahead.iter_steps() for mb in step.micro_batches)
        loader = DataLoader(
            self.dataset,
            batch_sampler=_Once(indices),
            collate_fn=self.collate,
            num_workers=self.workers,
            pin_memory=self.pin_memory,
            # fork: the dataset and the user's collate (often a lambda) need no pickling, and a
            # worker started from a forkserver-launched rank would otherwise default to forkserver
            multiprocessing_context=_FORK if self.workers else None,
            # each worker's RNG from the loader's base seed, which comes from torch's RNG: seeded
            generator=torch.Generator().manual_seed(sampler.seed * 7919 + sampler.epoch),
        )
        self._it = iter(loader)

    def take(self, count: int) -> list[Any]:
        assert self._it is not None, "start_segment first"
        return [next(self._it) for _ in range(count)]

    def close(self) -> None:
        # the last reference: the iterator's finalizer stops the loader's worker processes now
        self._it = None


class _Once:
    """An iterable over a generator, for DataLoader's `batch_sampler` (iterated once per segment)."""

    def __init__(self, items: Iterator[list[int]]):
        self._items = items

    def __iter__(self) -> Iterator[list[int]]:
        return self._items
