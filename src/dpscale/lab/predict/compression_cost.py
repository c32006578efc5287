"""What fp16 gradient compression costs a CPU worker beyond the bytes it saves on the wire.

Halving the bytes halves the transfer (model.py divides by `compression`), but on a CPU the
casting is compute on the worker's own cores: the hook (engine/hooks.py) divides each bucket into
a new fp16 tensor instead of in place, the shm transport copies a tensor it does not hold into
its staging segment and back (comm/shm.py), the sums add fp16 values (computed in fp32 and
rounded), and the result is cast back into the fp32 bucket. On the shm transport all of it runs
on the thread that runs backward (the reduction is synchronous), so it lengthens the step as
compute does. A GPU does the same casts at hundreds of GB/s, so GPU clusters get no such term.

`measure()` times these operations on this host, at the workers' intra-op thread count, as rates
per MiB of fp32 gradient; `extra_ms` turns them into the milliseconds one worker's step gains.
The rates are this host's at the time of the measurement: a loaded host measures slower casts, as
its workers would see them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

MB = 1 << 20
SAMPLE_MB = 4  # large enough to stream from memory like a 25 MiB bucket, small enough to take ms
ROUNDS = 9  # the median of these, each op timed once per round (interleaved: load drifts alike)


@dataclass(frozen=True, kw_only=True)
class CompressionCost:
    """Milliseconds per MiB of fp32 gradient, measured (`measure`) or given (tests)."""

    cast_in_ms_per_mb: float  # divide by the world size into a new fp16 tensor
    divide_ms_per_mb: float  # what the plain hook does instead: divide the fp32 bucket in place
    stage_ms_per_mb: float  # copy the fp16 tensor once (shm stages it in and copies it out: twice)
    cast_out_ms_per_mb: float  # copy the fp16 result back into the fp32 bucket
    add16_ms_per_mb: float  # add two fp16 tensors of that many elements
    add32_ms_per_mb: float  # the same in fp32
    # the transport copies a tensor it does not hold into its segments and back (shm: the plain
    # hook reduces the bucket where it lies, the compressed copy is new); gloo copies both alike
    staged: bool = True

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if name != "staged" and not value >= 0:
                raise ValueError(f"CompressionCost.{name}: must be >= 0 ms per MiB, got {value}")

    def extra_ms(self, grad_bytes: float, world_size: int) -> float:
        """What fp16 compression adds to one worker's step over the plain all-reduce, beyond the
        transfer it halves: `grad_bytes` of fp32 gradients reduced among `world_size` workers."""
        if world_size < 2:
            return 0.0
        mb = grad_bytes / MB
        casts = self.cast_in_ms_per_mb - self.divide_ms_per_mb + self.cast_out_ms_per_mb
        stage = 2 * self.stage_ms_per_mb if self.staged else 0.0
        # each worker adds (N - 1) copies of its 1/N part: (N - 1) / N of the gradient's elements,
        # in fp16; the transfer term already holds fp32 additions over half the bytes
        adds = (world_size - 1) / world_size * (self.add16_ms_per_mb - self.add32_ms_per_mb / 2)
        return max(0.0, mb * (casts + stage + adds))

    def to_dict(self) -> dict:
        return {k: v for k, v in vars(self).items()}

    @classmethod
    def from_dict(cls, doc: dict) -> CompressionCost:
        return cls(**doc)


def _median(times: list[float]) -> float:
    times = sorted(times)
    return times[len(times) // 2]


def measure(
    threads: int = 1, *, staged: bool = True, sample_mb: int = SAMPLE_MB, rounds: int = ROUNDS
) -> CompressionCost:
    """Time each operation of the fp16 path on this host with `threads` intra-op threads (the
    workers'), restoring the caller's thread count."""
    numel = sample_mb * MB // 4
    grad = torch.randn(numel)
    other = torch.randn(numel)
    out32 = torch.empty(numel)
    half = grad.to(torch.float16)
    half2 = other.to(torch.float16)
    out16 = torch.empty(numel, dtype=torch.float16)
    ops: dict[str, Callable[[], object]] = {
        "cast_in_ms_per_mb": lambda: torch.div(grad, 2, out=out16),
        "divide_ms_per_mb": lambda: grad.div_(1.0),
        "stage_ms_per_mb": lambda: out16.copy_(half),
        "cast_out_ms_per_mb": lambda: out32.copy_(half),
        "add16_ms_per_mb": lambda: torch.add(half, half2, out=out16),
        "add32_ms_per_mb": lambda: torch.add(grad, other, out=out32),
    }
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        for op in ops.values():
            op()  # first touch: page faults and kernel selection are not the rate
        times: dict[str, list[float]] = {k: [] for k in ops}
        for _ in range(rounds):
            for name, op in ops.items():
                start = time.perf_counter()
                op()
                times[name].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    rates = {k: _median(v) * 1e3 / sample_mb for k, v in times.items()}
    return CompressionCost(**rates, staged=staged)
