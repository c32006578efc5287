"""Global-batch sampler: which samples each rank sees at each optimizer step.

The user states the global batch G; with W ranks and k accumulation steps every rank gets k
micro-batches of G / (W * k) samples per step. The set of samples in each global batch depends only
on (dataset_size, global_batch, seed, epoch), never on W or k, so runs with different world sizes
see the same data per step, and a run can resume mid-epoch with a different world size.

A run may also change its global batch mid-epoch (a trainer that keeps the per-worker batch and
rescales the learning rate when the world size changes): `load_state_dict(state, regroup=True)`
continues from the sample the saved position had reached, grouping the rest of the epoch's
permutation by the new global batch, so no sample of the epoch is repeated or skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from dpscale.errors import ConfigError

TAIL_POLICIES = ("drop", "pad", "keep")


@dataclass(frozen=True)
class StepBatch:
    """One optimizer step as seen by one rank."""

    epoch: int
    step_in_epoch: int
    # samples in the whole global batch across all ranks: `global_batch`, except for a smaller
    # `keep` tail; divide summed losses by this, not by the local count, to weight samples equally
    global_count: int
    # this rank's `accumulation_steps` micro-batches; with tail="keep" the last step's may be short or empty
    micro_batches: list[list[int]]


def _steps(samples: int, global_batch: int, tail: str) -> int:
    """Global batches in `samples` samples: the complete ones, plus a short one unless dropped."""
    full, leftover = divmod(samples, global_batch)
    return full + (leftover > 0 and tail != "drop")


def _even_part(items: np.ndarray, parts: int, index: int) -> np.ndarray:
    """Part `index` of `items` split into `parts` contiguous pieces, as numpy.array_split does.

    The first len % parts pieces get one extra item; when the length divides evenly this is the
    plain equal split, so complete global batches and the `keep` tail share one code path.
    """
    size, extra = divmod(len(items), parts)
    start = index * size + min(index, extra)
    return items[start : start + size + (index < extra)]


class GlobalBatchSampler:
    """Hands this rank its micro-batches, k per optimizer step, and remembers the position.

    Order: with `shuffle`, epoch e uses `numpy.random.default_rng([seed, epoch]).permutation(n)`
    (seeding with the pair, not seed + epoch, keeps (seed 0, epoch 1) and (seed 1, epoch 0) apart);
    without it, 0..n-1. Global batch b is perm[b*G:(b+1)*G]; rank r takes its r-th contiguous
    W-th and splits that into k consecutive micro-batches.

    Tail (the n % G samples after the last complete global batch):
    - "drop": unused; every sample of a complete global batch is used once across all ranks.
    - "pad": completed to G by repeating the permutation from its start (as torch's
      DistributedSampler pads), so every micro-batch is full.
    - "keep": a smaller last global batch split as evenly as possible over ranks, then over
      micro-batches; some may be empty. Every sample is used exactly once.

    The position (epoch, next step) advances as steps are handed out, by `iter_steps()` or by
    `__iter__` (when the k-th micro-batch of a step is handed out, so a checkpoint taken
    mid-accumulation redoes that step). Iteration stops at the end of the epoch; call
    `set_epoch(epoch + 1)` to go on. The position is shared by all iterators of one sampler.

    After `load_state_dict(..., regroup=True)` with another global batch, the current epoch goes on
    from a sample offset: its remaining steps (`steps_this_epoch`) slice perm[offset:] and
    `step_in_epoch` counts from 0 again; the next epoch starts whole.
    """

    def __init__(
        self,
        dataset_size: int,
        *,
        global_batch: int,
        world_size: int,
        rank: int,
        accumulation_steps: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        tail: str = "drop",
    ):
        if dataset_size < 1:
            raise ConfigError(f"dataset_size {dataset_size} must be at least 1; the dataset is empty")
        if global_batch < 1:
            raise ConfigError(f"global_batch {global_batch} must be at least 1")
        if world_size < 1:
            raise ConfigError(f"world_size {world_size} must be at least 1")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} must be in [0, {world_size}) for world_size {world_size}")
        if accumulation_steps < 1:
            raise ConfigError(f"accumulation_steps {accumulation_steps} must be at least 1")
        if seed < 0:
            raise ConfigError(f"seed {seed} must be non-negative (it seeds numpy's SeedSequence)")
        if tail not in TAIL_POLICIES:
            raise ConfigError(f"tail {tail!r} is not one of {', '.join(map(repr, TAIL_POLICIES))}")
        parts = world_size * accumulation_steps
        if global_batch < parts:
            raise ConfigError(
                f"global_batch {global_batch} is smaller than world_size {world_size} "
                f"x accumulation_steps {accumulation_steps} = {parts}, so micro-batches would be empty; "
                f"use a global batch of at least {parts} or fewer ranks / accumulation steps"
            )
        if global_batch % parts:
            lower = global_batch // parts * parts
            raise ConfigError(
                f"global_batch {global_batch} is not divisible by world_size {world_size} "
                f"x accumulation_steps {accumulation_steps} = {parts}; "
                f"choose a global batch that is a multiple of {parts} (e.g. {lower} or {lower + parts})"
            )
        if tail == "drop" and global_batch > dataset_size:
            raise ConfigError(
                f"global_batch {global_batch} > dataset_size {dataset_size} leaves no complete global batch "
                f"with tail='drop'; use global_batch <= {dataset_size} or tail='pad' / tail='keep'"
            )
        self.dataset_size = dataset_size
        self.global_batch = global_batch
        self.world_size = world_size
        self.rank = rank
        self.accumulation_steps = accumulation_steps
        self.shuffle = shuffle
        self.seed = seed
        self.tail = tail
        self._epoch = 0
        self._next_step = 0
        # samples of this epoch consumed under an earlier global batch (regroup); 0 otherwise
        self._offset = 0
        # one permutation per epoch, computed once: every step of the epoch slices it
        self._perm_epoch: int | None = None
        self._perm = np.empty(0, dtype=np.int64)

    @property
    def micro_batch(self) -> int:
        """Samples per micro-batch per rank (for complete global batches)."""
        return self.global_batch // (self.world_size * self.accumulation_steps)

    @property
    def steps_per_epoch(self) -> int:
        """Global batches, i.e. optimizer steps, per whole epoch."""
        return self._steps_for(self.dataset_size)

    @property
    def steps_this_epoch(self) -> int:
        """Steps of the current epoch: `steps_per_epoch`, or fewer after a regrouped resume."""
        return self._steps_for(self.dataset_size - self._offset)

    @property
    def sample_offset(self) -> int:
        """Samples of the current epoch consumed before the current grouping (0 unless regrouped)."""
        return self._offset

    def _steps_for(self, samples: int) -> int:
        return _steps(samples, self.global_batch, self.tail)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def step_in_epoch(self) -> int:
        """The next step to hand out; equals `steps_this_epoch` once the epoch is exhausted."""
        return self._next_step

    def __len__(self) -> int:
        """Micro-batches per full epoch for this rank (a `keep` tail still counts k, maybe empty)."""
        return self.steps_per_epoch * self.accumulation_steps

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of `epoch`. Not needed right after `load_state_dict`, which would be undone."""
        if epoch < 0:
            raise ConfigError(f"epoch {epoch} must be non-negative")
        self._epoch = epoch
        self._next_step = 0
        self._offset = 0

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self._epoch:
            if self.shuffle:
                rng = np.random.default_rng([self.seed, self._epoch])
                self._perm = rng.permutation(self.dataset_size)
            else:
                self._perm = np.arange(self.dataset_size)
            self._perm_epoch = self._epoch
        return self._perm

    def _step_batch(self, step: int) -> StepBatch:
        perm = self._permutation()
        start = self._offset + step * self.global_batch
        batch = perm[start : start + self.global_batch]
        if self.tail == "pad" and len(batch) < self.global_batch:
            # np.resize repeats cyclically, which also covers a global batch larger than the dataset
            batch = np.concatenate([batch, np.resize(perm, self.global_batch - len(batch))])
        local = _even_part(batch, self.world_size, self.rank)
        micro = [
            _even_part(local, self.accumulation_steps, i).tolist() for i in range(self.accumulation_steps)
        ]
        return StepBatch(epoch=self._epoch, step_in_epoch=step, global_count=len(batch), micro_batches=micro)

    def iter_steps(self) -> Iterator[StepBatch]:
        """Yield this rank's steps from the current position to the end of the epoch."""
        while self._next_step < self.steps_this_epoch:
            step = self._step_batch(self._next_step)
            # advance before handing out: a state_dict taken after consuming this step resumes at the next
            self._next_step += 1
            yield step

    def __iter__(self) -> Iterator[list[int]]:
        """Yield this rank's micro-batches (k per step), for `DataLoader(batch_sampler=...)`."""
        while self._next_step < self.steps_this_epoch:
            *head, last = self._step_batch(self._next_step).micro_batches
            yield from head
            # the step counts as taken only with its last micro-batch: the accumulated gradient of a
            # partial step is not in any checkpoint, so resuming must redo the whole step
            self._next_step += 1
            yield last

    def state_dict(self) -> dict[str, int | str | bool]:
        """Position in global batches plus the configuration that gives it meaning."""
        return {
            "epoch": self._epoch,
            "step_in_epoch": self._next_step,
            "sample_offset": self._offset,
            "dataset_size": self.dataset_size,
            "global_batch": self.global_batch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "tail": self.tail,
        }

    def load_state_dict(self, state: dict[str, int | str | bool], *, regroup: bool = False) -> None:
        """Restore the position; world_size, rank and accumulation_steps may differ from the saver's.

        With `regroup=True` the saved global batch may differ too: the epoch goes on from the first
        sample the saved position had not used (an exhausted epoch: from the next epoch's start).
        """
        names = ("dataset_size", "seed", "shuffle", "tail") + (() if regroup else ("global_batch",))
        for name in names:
            if state[name] != getattr(self, name):
                raise ConfigError(
                    f"saved {name} {state[name]!r} differs from this sampler's {getattr(self, name)!r}; "
                    f"construct the sampler with {name}={state[name]!r} to resume this position"
                )
        saved = (state["global_batch"], state["epoch"], state["step_in_epoch"], state.get("sample_offset", 0))
        counts = [v for v in saved if type(v) is int]
        if len(counts) < len(saved) or counts[0] < 1:
            raise ConfigError(
                f"saved global_batch {saved[0]!r}, epoch {saved[1]!r}, step_in_epoch {saved[2]!r} or "
                f"sample_offset {saved[3]!r} is not a valid count; the state is corrupt"
            )
        saved_g, epoch, step, offset = counts
        n = self.dataset_size
        saved_steps = _steps(n - offset, saved_g, self.tail) if 0 <= offset <= n else 0
        if epoch < 0 or not 0 <= offset <= n or not 0 <= step <= saved_steps:
            raise ConfigError(
                f"saved position epoch {epoch}, step_in_epoch {step}, sample_offset {offset} is outside "
                f"epoch >= 0, 0 <= sample_offset <= {n} and 0 <= step_in_epoch <= {saved_steps}; "
                "the state is corrupt"
            )
        self._epoch, self._next_step, self._offset = epoch, step, offset
        if saved_g == self.global_batch:
            return
        if step == saved_steps:  # the saved epoch is over (a dropped tail stays dropped)
            self.set_epoch(epoch + 1)
        else:
            self._offset, self._next_step = offset + step * saved_g, 0
