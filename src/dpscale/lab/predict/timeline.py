"""One backward pass overlapped with its bucket reductions: when each runs, and what stays exposed.

Buckets are reduced one at a time, in bucket order (collectives are matched by issue order across
workers, so the engine launches bucket k+1 only after bucket k, see engine/reducer.py), on one
link: a bucket's reduction starts when the bucket is ready *and* the previous reduction is done.
Without overlap every reduction waits for the end of backward. The exposed communication is what
runs past the end of backward: the time overlap did not hide.

All times are ms from the start of backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dpscale.errors import ConfigError


@dataclass(frozen=True)
class ReadyBucket:
    index: int
    nbytes: int
    ready_ms: float  # when its last gradient is ready, from the start of backward


@dataclass(frozen=True)
class BucketSpan:
    index: int
    nbytes: int
    ready_ms: float
    start_ms: float
    end_ms: float

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass(frozen=True)
class Timeline:
    backward_ms: float
    spans: tuple[BucketSpan, ...]

    @property
    def comm_ms(self) -> float:
        """Total time the link is busy (the reductions never overlap each other)."""
        return sum(s.duration_ms for s in self.spans)

    @property
    def end_ms(self) -> float:
        """When backward and every reduction are done."""
        return max([self.backward_ms, *(s.end_ms for s in self.spans)])

    @property
    def exposed_comm_ms(self) -> float:
        return self.end_ms - self.backward_ms

    @property
    def hidden_comm_ms(self) -> float:
        return self.comm_ms - self.exposed_comm_ms


def simulate(
    buckets: Sequence[ReadyBucket],
    backward_ms: float,
    reduce_ms: Callable[[int], float],
    *,
    overlap: bool = True,
) -> Timeline:
    """Schedule `buckets` (in bucket order) on one link; `reduce_ms(nbytes)` is one reduction's time."""
    if backward_ms < 0:
        raise ConfigError(f"backward time must be >= 0 ms, got {backward_ms}")
    spans, link_free_ms = [], 0.0
    for b in buckets:
        if not 0 <= b.ready_ms <= backward_ms + 1e-9:
            raise ConfigError(
                f"bucket {b.index} is ready at {b.ready_ms} ms, outside backward [0, {backward_ms}]"
            )
        ready = b.ready_ms if overlap else backward_ms
        start = max(ready, link_free_ms)
        end = start + reduce_ms(b.nbytes)
        spans.append(BucketSpan(b.index, b.nbytes, b.ready_ms, start, end))
        link_free_ms = end
    return Timeline(backward_ms, tuple(spans))
