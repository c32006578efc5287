"""`bucket_cap_mb="auto"`: try a few bucket sizes on the first steps, keep the fastest.

The best size depends on the transport and the model: small buckets start communication early
(more overlap with an asynchronous transport) but pay the per-message latency more often; one
large bucket does the opposite. Instead of guessing, the engine runs each candidate for a few
synchronized steps, measures the time from one synced forward to the next (the whole step,
optimizer included, as the user's loop runs it), and keeps the candidate whose median is lowest
on the slowest rank. The schedule is a function of the synced-step count, so every rank switches
buckets at the same step, which the collective bucket allocation requires.

Steps are timed with the engine's clock (clock.py): CUDA events on a GPU, where host time would
measure the launches. They are read at the decision, the one point of the run where the tuner
waits for the device (every rank decides at the same step, so each needs every time by then).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dpscale.comm.group_device import collective_device
from dpscale.engine.clock import Clock, HostClock

CANDIDATES_MB = (1.0, 5.0, 25.0, 100.0)
WARMUP_STEPS = 1  # the first step on new buckets touches fresh memory: not representative
MEASURED_STEPS = 4


@dataclass
class AutotuneDecision:
    """What the tuner tried and kept; rank 0 logs it and the engine exposes it."""

    candidates_mb: list[float]
    median_step_ms: list[float]
    chosen_mb: float

    def describe(self) -> str:
        tried = ", ".join(
            f"{c:g} MB: {t:.1f} ms" for c, t in zip(self.candidates_mb, self.median_step_ms, strict=True)
        )
        return f"bucket_cap_mb auto: median step {tried}; keeping {self.chosen_mb:g} MB"


@dataclass
class BucketAutotuner:
    process_group: dist.ProcessGroup | None
    candidates_mb: tuple[float, ...] = CANDIDATES_MB
    warmup_steps: int = WARMUP_STEPS
    measured_steps: int = MEASURED_STEPS
    decision: AutotuneDecision | None = None
    clock: Clock = field(default_factory=HostClock)  # the engine's (clock.py)
    _step: int = 0
    _last_t: Any = None
    _windows: list[tuple[float, Any, Any]] = field(default_factory=list)  # (cap, start, end) stamps

    @property
    def done(self) -> bool:
        return self.decision is not None

    def _cap_at(self, step: int) -> tuple[float, bool]:
        """(cap, measured?) for synced step `step` of the schedule."""
        per = self.warmup_steps + self.measured_steps
        cap = self.candidates_mb[step // per]
        return cap, step % per >= self.warmup_steps

    @property
    def first_cap_mb(self) -> float:
        return self.candidates_mb[0]

    def on_synced_forward(self, now: Any) -> float | None:
        """Call at each synced forward with a stamp of `clock`; returns the bucket cap to switch
        to now, or None."""
        if self.done:
            return None
        if self._last_t is not None:
            cap, measured = self._cap_at(self._step - 1)
            if measured:
                self._windows.append((cap, self._last_t, now))
        self._last_t = now
        total = len(self.candidates_mb) * (self.warmup_steps + self.measured_steps)
        if self._step == total:
            return self._decide()
        cap, _ = self._cap_at(self._step)
        previous = self._cap_at(self._step - 1)[0] if self._step else cap
        self._step += 1
        return cap if cap != previous else None

    def _times_ms(self) -> dict[float, list[float]]:
        clock = self.clock
        clock.wait([t for _, start, end in self._windows for t in (start, end)])
        times: dict[float, list[float]] = {}
        for cap, start, end in self._windows:
            times.setdefault(cap, []).append(clock.elapsed_ms(start, end))
        return times

    def _decide(self) -> float:
        times = self._times_ms()
        medians = torch.tensor(
            [statistics.median(times[c]) for c in self.candidates_mb],
            dtype=torch.float64,
            device=collective_device(self.process_group),
        )
        # the slowest rank sets the pace, and every rank must choose the same size
        dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=self.process_group)
        best = int(torch.argmin(medians))
        self.decision = AutotuneDecision(
            list(self.candidates_mb), medians.cpu().tolist(), self.candidates_mb[best]
        )
        return self.decision.chosen_mb
