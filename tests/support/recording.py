"""Record which samples a `Trainer` takes at each step: for tests of the data order across resumes."""

from __future__ import annotations


def record_batches(trainer) -> list[tuple[int, list[int]]]:
    """A list that fills, as `trainer` trains, with (epoch, this rank's samples of the step in order)."""
    seen: list[tuple[int, list[int]]] = []
    next_batch = trainer._next_batch

    def recording():
        batch = next_batch()
        seen.append((batch.epoch, [i for micro in batch.micro_batches for i in micro]))
        return batch

    trainer._next_batch = recording
    return seen
