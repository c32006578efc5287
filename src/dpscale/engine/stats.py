"""Per-step communication measurements, cheap enough to take on every synced step.

Times are host wall-clock (`time.perf_counter`) relative to the end of forward, in ms. On CUDA
the host learns of completion only when it waits, so there `end_ms` is an upper bound.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class BucketTiming:
    index: int
    nbytes: int
    start_s: float = 0.0
    end_s: float = 0.0
    blocking_s: float = 0.0  # how long launching it held up the caller (all of it, if synchronous)


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
    def from_timings(
        cls, *, step: int, t0: float, t_backward_end: float, t_done: float, timings: list[BucketTiming]
    ) -> StepStats:
        ms = lambda t: (t - t0) * 1e3
        buckets = [BucketStats(t.index, t.nbytes, ms(t.start_s), ms(t.end_s)) for t in timings]
        held_up_ms = sum(t.blocking_s for t in timings if t.start_s < t_backward_end) * 1e3
        return cls(
            step=step,
            backward_ms=ms(t_backward_end) - held_up_ms,
            comm_ms=_union_ms(buckets),
            exposed_comm_ms=held_up_ms + max(0.0, (t_done - t_backward_end) * 1e3),
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
