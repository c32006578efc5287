"""Collated micro-batches for the sampler's steps, through a DataLoader (optionally with workers).

The sampler decides which samples each micro-batch holds and keeps the position checkpoints
save. A DataLoader with workers reads ahead, so it must not advance that position: it iterates a
copy of the sampler, started at the same position, while the trainer advances the real one step
by step. Both yield the same index lists in the same order, so each step's micro-batches pair up.
An empty micro-batch (a short `keep` tail) is loaded as sample 0 and weighted zero by the trainer:
the synchronized backward must run on every rank even with nothing to add.

`prefetch` loads the next step's micro-batches while the device still works on this one and starts
their copies to it (non-blocking from pinned memory on CUDA). The sampler's position, what a
checkpoint saves, does not count them. Loading in this process (no workers) may draw from the
global RNGs (a random augmentation), and so may the user's callbacks after the prefetch (its
after_reduce and after_step run later in the same step). A checkpoint therefore holds the RNGs as
they are when it is saved (every draw so far, the callbacks' included) and, beside them, the RNGs
the pending prefetch loaded under (`pending_rng`). A resumed run loads that step again under those
(`start_segment(replay_rng=...)`), then goes on from the saved ones: it draws what the unbroken run
drew, in the same places. A prefetch dropped unused (a new segment after a re-split) keeps its
draws, as a resumed run's saved RNGs do.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from dpscale.data.sampler import GlobalBatchSampler
from dpscale.train.checkpoint.rank_state import capture_rng_state, restore_rng_state
from dpscale.workloads.task import to_device

_FORK = "fork" if "fork" in mp.get_all_start_methods() else None


class MicroBatches:
    """`take(n)` returns the next n collated micro-batches (one optimizer step's); `prefetch(n)`
    loads them ahead, on `device` if given."""

    def __init__(
        self,
        dataset: Dataset,
        collate,
        *,
        workers: int = 0,
        pin_memory: bool = False,
        device: torch.device | None = None,
    ):
        self.dataset = dataset
        self.collate = collate
        self.workers = workers
        self.pin_memory = pin_memory
        self.device = device
        self._it: Iterator[Any] | None = None
        self._ahead: list[Any] | None = None  # the next step's micro-batches, loaded early
        self._rng_before: dict[str, Any] | None = None  # the RNGs before loading them here
        self._replay_rng: dict[str, Any] | None = None  # the RNGs the next load runs under

    def start_segment(self, sampler: GlobalBatchSampler, replay_rng: dict[str, Any] | None = None) -> None:
        """Read the micro-batches of the sampler's remaining steps in this epoch from where it is now.

        `replay_rng`: the RNGs the segment's first step was loaded under before a checkpoint
        (`pending_rng` then); it is loaded under them again, and the RNGs are left as they were."""
        self.close()
        self._replay_rng = replay_rng
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
        if self._ahead is not None:
            ahead, self._ahead, self._rng_before = self._ahead, None, None
            assert len(ahead) == count, "a step's micro-batch count changes only with a new segment"
            return ahead
        if self._replay_rng is None:
            return [next(self._it) for _ in range(count)]
        now, replay, self._replay_rng = capture_rng_state(), self._replay_rng, None
        restore_rng_state(replay)
        try:
            return [next(self._it) for _ in range(count)]
        finally:
            restore_rng_state(now)

    def prefetch(self, count: int) -> None:
        """Load the next step's `count` micro-batches now and start their copies to the device;
        nothing at the end of the segment."""
        if self._it is None or self._ahead is not None:
            return
        if self.workers == 0:
            self._rng_before = capture_rng_state()
        # a segment holds whole steps: the next one is all there or not at all
        loaded = [batch for _, batch in zip(range(count), self._it, strict=False)]
        if len(loaded) < count:
            assert not loaded, "a segment holds whole steps"
            self._rng_before = None
            return
        self._ahead = loaded if self.device is None else to_device(loaded, self.device, non_blocking=True)

    def pending_rng(self) -> dict[str, Any] | None:
        """The global RNGs as they were before the pending prefetch drew from them (None: nothing
        prefetched, or loaded by workers, whose RNGs are their own)."""
        return self._rng_before

    def close(self) -> None:
        # a prefetch never used keeps its draws: the callbacks may have drawn after it, and a
        # resumed run's saved RNGs hold both (module docstring)
        self._ahead = self._rng_before = self._replay_rng = None
        # the last reference: the iterator's finalizer stops the loader's worker processes now
        self._it = None


class _Once:
    """An iterable over a generator, for DataLoader's `batch_sampler` (iterated once per segment)."""

    def __init__(self, items: Iterator[list[int]]):
        self._items = items

    def __iter__(self) -> Iterator[list[int]]:
        return self._items
