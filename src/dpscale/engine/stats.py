"""Per-step communication measurements, cheap enough to take on every synced step.

Times are in ms from the end of forward, taken with the engine's clock (clock.py): host time on
CPU, CUDA events on the compute and communication streams on a GPU. A step's stamps form a
`StepWindow`, turned into `StepStats` once the clock says every stamp is final: at once on the
host, at a later step on a GPU (the stats then arrive a step or more late, never by waiting).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dpscale.engine.clock import Clock, HostRead


@dataclass
class BucketTiming:
    index: int
    nbytes: int
    start: Any = None  # the clock's stamps (clock.py); end None: done when the step's wait was
    end: Any = None
    blocking_ms: float = 0.0  # host time launching it held up backward (all of it, if synchronous)


@dataclass
class StepWindow:
    """One synced step's stamps (and gradient norms on their way to the host), until final."""

    step: int
    forward_end: Any
    backward_end: Any
    done: Any
    timings: list[BucketTiming]
    norms: HostRead | None = None  # (local, reduced) squared norms, see Reducer._grad_norms

    def stamps(self) -> list[Any]:
        ends = [t.end for t in self.timings if t.end is not None]
        return [self.forward_end, self.backward_end, self.done, *(t.start for t in self.timings), *ends]

    def ready(self, clock: Clock) -> bool:
        return clock.ready(self.stamps()) and (self.norms is None or self.norms.ready())


@dataclass
class BucketStats:
    index: int
    nbytes: int
    start_ms: float
    end_ms: float


@dataclass
class StepStats:
    """What the last synced backward spent where.

    - `backward_ms`: end of forward until autograd finished (the loss and backward compute),
      less the time backward was held up by reductions running on its own thread.
    - `comm_ms`: time during which at least one bucket's reduction was in flight.
    - `exposed_comm_ms`: communication that overlap did not hide: the time backward was held up
      by synchronous reductions, plus the wait from the end of backward until every reduction
      had finished. For an asynchronous transport (gloo, NCCL) it is mostly the wait; for a
      synchronous one (shm) it is all of comm_ms.
    - `grad_sq_norm_local` / `grad_sq_norm_global`: this rank's squared gradient norm before the
      reduction and the averaged gradient's after it (dense buckets; None when not measured).
    - `gradient_noise_scale`: this rank's smoothed B_simple (see noise_scale.py) in units of one
      rank's batch (multiply by its samples for samples); None with one worker or too few steps.
    """

    step: int
    backward_ms: float
    comm_ms: float
    exposed_comm_ms: float
    buckets: list[BucketStats] = field(default_factory=list)
    grad_sq_norm_local: float | None = None
    grad_sq_norm_global: float | None = None
    gradient_noise_scale: float | None = None

    @property
    def comm_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_window(cls, window: StepWindow, clock: Clock) -> StepStats:
        """The stats of a window whose stamps are final (`window.ready(clock)`)."""
        t0 = window.forward_end
        ms = lambda stamp: clock.elapsed_ms(t0, stamp)
        backward_end_ms, done_ms = ms(window.backward_end), ms(window.done)
        buckets = [
            BucketStats(t.index, t.nbytes, ms(t.start), done_ms if t.end is None else ms(t.end))
            for t in window.timings
        ]
        timed = zip(window.timings, buckets, strict=True)
        held_up_ms = sum(t.blocking_ms for t, b in timed if b.start_ms < backward_end_ms)
        return cls(
            step=window.step,
            backward_ms=backward_end_ms - held_up_ms,
            comm_ms=_union_ms(buckets),
            exposed_comm_ms=held_up_ms + max(0.0, done_ms - backward_end_ms),
            buckets=buckets,
        )


def _union_ms(buckets: list[BucketStats]) -> float:
    total = 0.0
    span: tuple[float, float] | None = None  # the interval being merged
    for b in sorted(buckets, key=lambda b: b.start_ms):
        if span is None or b.start_ms > span[1]:
            if span is not None:
                total += span[1] - span[0]
            span = (b.start_ms, b.end_ms)
        else:
            span = (span[0], max(span[1], b.end_ms))
    if span is not None:
        total += span[1] - span[0]
    return total
