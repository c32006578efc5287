"""Step telemetry from inside a DDP module, for training scripts dpscale did not write.

A synchronized step is every training forward up to and including one run with gradient sync on
(`require_backward_grad_sync`, what `no_sync()` turns off for accumulation micro-steps); the step
ends when the next training forward starts, so its time holds the backward, the optimizer step
and loading the next batch, the whole iteration as the script runs it. Its samples are the batch
dimension (dim 0) of each forward's first tensor input. Because every rank runs the same
synchronized steps (their backward is a collective), counting them gives every rank the same
place to stop: `StepTelemetry` calls `on_limit` at the forward that would begin step
`limit + 1`, the same step everywhere.

Each record also splits its step into phases that add up to it (`StepMarks.phases`), from what
the caller marks within the step: each training forward's end, each backward's start and end, each
optimizer step's end (`dpscale run` marks them from the script's `Tensor.backward` and optimizer
hooks, launch/script_watch.py), and whether an evaluation or a checkpoint ran in it.

Two DDP classes carry it: dpscale's engine, whose per-step stats give exposed communication, and
a subclass of torch's, which times its all-reduces through a comm hook (exposed: from the last
bucket's launch, about when backward's last gradient is ready, to the last one's completion).

Times come from the engine's clock (clock.py): CUDA events on a GPU, where host time around an
NCCL collective measures its launch. A step's record is kept once its events have completed, at a
later step; the limit counts steps as they run (the same step on every rank), and the records
still pending are waited for once, when the telemetry is written (`to_dict`). On a GPU dpscale's
engine gives a step's exposed communication when its stats are readable: the latest so far.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from dpscale.engine.clock import Clock, HostClock, clock_for
from dpscale.engine.ddp import DistributedDataParallel
from dpscale.engine.stats import StepStats
from dpscale.engine.trace import TraceWindow


@dataclass
class StepRecord:
    step_ms: float
    samples: int  # this rank's, over the step's forwards
    micro_steps: int
    exposed_comm_ms: float | None
    backward_ms: float | None  # dpscale's engine: end of forward to end of autograd, less held-up time
    # the step's phases in ms (`StepMarks.phases`; None where the step had no backward marked); with
    # defaults, as the fields below: records written before they were kept lack them
    phases: dict[str, float] | None = None
    optimizer_steps: int = 0  # optimizer steps that ended in this step (0: none seen)
    evaluations: int = 0  # evaluation forwards (eval mode or no grad) in this step
    checkpoints: int = 0  # torch.save calls in this step
    forward_total_ms: float = 0.0  # every training forward of the step, its micro-steps' included
    backward_total_ms: float = 0.0  # every backward of the step, its micro-steps' included
    # only on the steps a trace window holds (trace.py): the step's number (from 1), its start on
    # the host clock (perf_counter s) and each bucket's reduction in ms from that start
    step: int | None = None
    start_s: float | None = None
    buckets: list[dict] | None = None


PHASES = ("micro_steps_ms", "forward_ms", "backward_ms", "exposed_comm_ms", "optimizer_ms", "data_wait_ms")
"""A step's phases in time order. A step runs from its first training forward to the next step's:
the accumulation micro-steps before the synced one, the synced forward (to its backward's start),
backward less the communication it waited for, that exposed communication, the optimizer (from
backward's end to the last optimizer step's end) and the wait for the next step's first forward
(loading its data, the script's logging, an evaluation)."""


@dataclass
class StepMarks:
    """What happened inside the current step (perf_counter seconds), for its phases."""

    last_forward: float | None = None  # start of the step's last training forward
    synced_forward_end: float | None = None  # end of its synced forward (a trace's bucket origin)
    forward_total_s: float = 0.0
    backward: tuple[float, float] | None = None  # the step's last backward: (start, end)
    backward_total_s: float = 0.0
    optimizer_end: float | None = None
    optimizer_steps: int = 0
    evaluations: int = 0
    checkpoints: int = 0

    def phases(self, start: float, end: float, exposed_comm_ms: float | None) -> dict[str, float] | None:
        """The phases of a step from `start` to `end` (PHASES); they add up to its time."""
        if self.backward is None or self.last_forward is None:
            return None
        bwd_start, bwd_end = self.backward
        # no optimizer step: a synced accumulation micro-step (script_phases.py folds it into the next)
        opt_end = max(self.optimizer_end or bwd_end, bwd_end)
        backward_ms = (bwd_end - bwd_start) * 1e3
        exposed = min(max(exposed_comm_ms or 0.0, 0.0), backward_ms)  # within the backward it ends
        return {
            "micro_steps_ms": (self.last_forward - start) * 1e3,
            "forward_ms": (bwd_start - self.last_forward) * 1e3,
            "backward_ms": backward_ms - exposed,
            "exposed_comm_ms": exposed,
            "optimizer_ms": (opt_end - bwd_end) * 1e3,
            "data_wait_ms": (end - opt_end) * 1e3,
        }


@dataclass
class Span:
    """Two stamps of the clock (a communication interval measured by events): ms once read."""

    start: Any
    end: Any


@dataclass
class StepTelemetry:
    """Per-step records of one rank; `on_limit()` runs once `limit` steps are complete."""

    limit: int | None = None
    on_limit: Callable[[StepTelemetry], None] | None = None
    records: list[StepRecord] = field(default_factory=list)
    forward_ms: list[float] = field(default_factory=list)  # of synchronized forwards
    clock: Clock = field(default_factory=HostClock)
    steps: int = 0  # steps complete, records pending included
    _start: Any = None
    _samples: int = 0
    _micro: int = 0
    _synced: bool = False
    # steps and forwards timed and not yet read: (start, end, samples, micro, comm) / (start, end)
    _pending: list[tuple] = field(default_factory=list)
    _pending_forwards: list[tuple[Any, Any]] = field(default_factory=list)
    marks: StepMarks = field(default_factory=StepMarks)
    # the steps a trace holds (trace.py): each gets its start and its buckets' reductions
    trace: TraceWindow | None = None
    # keep only the records of `trace`'s steps (a run with no step limit stays bounded)
    trace_only: bool = False

    def on_forward(
        self,
        inputs: tuple,
        kwargs: Mapping,
        synced: bool,
        comm: Callable[[], tuple],
        buckets: Callable[[], list[dict] | None] | None = None,
    ):
        """Called at each training forward; `comm()` gives the last synced backward's
        (exposed_comm_ms, backward_ms), each None when not measured or a `Span` to read later;
        `buckets()`, asked on traced steps only, its buckets' reductions ({"index", "nbytes",
        "start_s", "end_s"} on the host clock), None where not measured."""
        now = self.clock.stamp()
        if self._synced:  # the previous forward ended a step: this one begins the next
            assert self._start is not None  # set by the forward that began the step
            traced = self._traced(self.steps + 1, buckets)
            # the step's marks are host times (perf_counter): its phases are computed when read
            self._pending.append((self._start, now, self._samples, self._micro, comm(), self.marks, traced))
            self._start, self._samples, self._micro, self.marks = None, 0, 0, StepMarks()
            self.steps += 1
            self.read(wait=False)
            if self.steps == self.limit and self.on_limit is not None:
                self.on_limit(self)
        if self._start is None:
            self._start = now
        self._samples += batch_size(inputs, kwargs)
        self._micro += 1
        self._synced = synced
        self.marks.last_forward = now if isinstance(now, float) else None  # host marks only

    def _traced(self, step: int, buckets: Callable[[], list[dict] | None] | None) -> dict | None:
        """What a trace needs of step `step` beyond its record; None outside the window (or on a
        device clock, whose stamps are not host times)."""
        if self.trace is None or step not in self.trace or not isinstance(self._start, float):
            return None
        start = self._start
        spans = buckets() if buckets is not None else None
        return {
            "step": step,
            "start_s": start,
            "buckets": None
            if spans is None
            else [
                {
                    "index": b["index"],
                    "nbytes": b["nbytes"],
                    "start_ms": (b["start_s"] - start) * 1e3,
                    "end_ms": (b["end_s"] - start) * 1e3,
                }
                for b in spans
            ],
        }

    def end_step(self) -> None:
        """The step ends at the next training forward, as after a synced one (a model without DDP:
        its optimizer step ends the step)."""
        if self._start is not None:
            self._synced = True

    def add_samples(self, n: int) -> None:
        self._samples += n

    def on_forward_timed(self, start: Any, end: Any) -> None:
        if not self.trace_only:  # bounded: a traced run without a step limit keeps no list per step
            self._pending_forwards.append((start, end))

    def read(self, *, wait: bool) -> None:
        """Pending steps and forwards into `records` and `forward_ms`, oldest first: those whose
        events are complete, or (`wait`) all of them."""
        clock = self.clock
        # host stamps are complete when taken: no list of them to build, check or wait for, on
        # the path every step takes (issue #31's cost bound)
        host_clock = isinstance(clock, HostClock)
        while self._pending and (wait or host_clock or clock.ready(self._stamps(self._pending[0]))):
            entry = self._pending.pop(0)
            if not host_clock:
                clock.wait(self._stamps(entry))
            start, end, samples, micro, comm, marks, traced = entry
            if self.trace_only and traced is None:
                continue
            exposed, backward = map(self._ms, comm)
            # phases from host marks: only where the step's own stamps are host times too (on a
            # GPU they would mix the host's enqueue times with the device's)
            host = isinstance(start, float)
            self.records.append(
                StepRecord(
                    clock.elapsed_ms(start, end),
                    samples,
                    micro,
                    exposed,
                    backward,
                    phases=marks.phases(start, end, exposed) if host else None,
                    optimizer_steps=marks.optimizer_steps,
                    evaluations=marks.evaluations,
                    checkpoints=marks.checkpoints,
                    forward_total_ms=marks.forward_total_s * 1e3,
                    backward_total_ms=marks.backward_total_s * 1e3,
                    **(traced or {}),
                )
            )
        while self._pending_forwards and (wait or host_clock or clock.ready(self._pending_forwards[0])):
            start, end = self._pending_forwards.pop(0)
            if not host_clock:
                clock.wait([start, end])
            self.forward_ms.append(clock.elapsed_ms(start, end))

    @staticmethod
    def _stamps(entry: tuple) -> list[Any]:
        spans = [s for s in entry[4] if isinstance(s, Span)]
        return [entry[0], entry[1], *(t for s in spans for t in (s.start, s.end))]

    def _ms(self, value: float | Span | None) -> float | None:
        if isinstance(value, Span):
            return max(0.0, self.clock.elapsed_ms(value.start, value.end))
        return value

    def to_dict(self) -> dict:
        self.read(wait=True)  # written once, at the end: the one wait for the device
        return {"records": [asdict(r) for r in self.records], "forward_ms": self.forward_ms}


def batch_size(inputs: tuple, kwargs: Mapping) -> int:
    """dim 0 of the first tensor among the positional, then the keyword inputs (0: none)."""
    for value in (*inputs, *kwargs.values()):
        t = _first_tensor(value)
        if t is not None:
            return int(t.shape[0]) if t.dim() else 1
    return 0


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):
        value = list(value.values())
    for v in value if isinstance(value, (list, tuple)) else ():
        if (t := _first_tensor(v)) is not None:
            return t
    return None


class _Timed:
    """Shared by both classes: count training forwards, time synchronized ones."""

    telemetry: StepTelemetry

    def _timed_forward(self, forward, inputs, kwargs):
        if not (self.training and torch.is_grad_enabled()):
            self.telemetry.marks.evaluations += 1
            return forward(*inputs, **kwargs)  # evaluation passes are not training steps
        synced = bool(self.require_backward_grad_sync)
        telemetry = self.telemetry
        telemetry.on_forward(inputs, kwargs, synced, self._comm_stats, self._bucket_spans)
        t0 = telemetry.clock.stamp()
        h0 = time.perf_counter()  # the phases' host marks (StepMarks), beside the clock's stamp
        out = forward(*inputs, **kwargs)
        h1 = time.perf_counter()
        telemetry.marks.forward_total_s += h1 - h0
        if synced:
            telemetry.marks.synced_forward_end = h1
            telemetry.on_forward_timed(t0, telemetry.clock.stamp())
        return out


class TelemetryDDP(_Timed, DistributedDataParallel):
    """dpscale's engine with step telemetry in `.telemetry` (set a limit there to stop the run)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.telemetry = StepTelemetry(clock=self.reducer.clock)

    def forward(self, *inputs, **kwargs):
        return self._timed_forward(super().forward, inputs, kwargs)

    def _comm_stats(self) -> tuple[float | None, float | None]:
        stats = self.last_step_stats
        return (stats.exposed_comm_ms, stats.backward_ms) if stats is not None else (None, None)

    def _bucket_spans(self) -> list[dict] | None:
        return bucket_spans(self.last_step_stats, self.telemetry.marks.synced_forward_end)


def bucket_spans(stats: StepStats | None, origin: float | None) -> list[dict] | None:
    """A synced backward's reductions on the host clock: the engine times them from the end of its
    forward, `origin` the host time the caller saw that forward return (within the wrapper's
    return of the engine's stamp)."""
    if stats is None or origin is None:
        return None
    return [
        {
            "index": b.index,
            "nbytes": b.nbytes,
            "start_s": origin + b.start_ms / 1e3,
            "end_s": origin + b.end_ms / 1e3,
        }
        for b in stats.buckets
    ]


@dataclass
class _CommTimes:
    # No process group here: a bucket's completion callback holds this, and gloo destroys that
    # callback on its worker thread after running it. Were the callback the group's last owner
    # (the script already past destroy_process_group), the group's destructor would run on its own
    # worker thread and join it: "Resource deadlock avoided", the process aborted (seen once in
    # CI's compat tier; every time with the worker's window widened, tests/engine/test_telemetry.py).
    clock: Clock = field(default_factory=HostClock)
    last_launch: Any = None
    last_done: Any = None
    # while a trace is on: this synced backward's buckets (index, bytes, launch, completion)
    spans: list[dict] | None = None


def _timed(hook):
    """Wrap a comm hook: stamp each bucket's launch and completion in the state's `_CommTimes`."""

    def timed_hook(state: tuple[_CommTimes, Any], bucket):
        times, inner = state
        times.last_launch = launch = times.clock.stamp()
        span = None
        if times.spans is not None:
            if bucket.index() == 0:  # a new backward: the last one's spans were read or not wanted
                times.spans.clear()
            buffer = bucket.buffer()
            span = {
                "index": bucket.index(),
                "nbytes": buffer.numel() * buffer.element_size(),
                "start_s": launch,
            }
            times.spans.append(span)

        def done(fut):
            # on CUDA the current stream here waits for the collective: an event marks its end
            times.last_done = times.clock.stamp()
            if span is not None:
                span["end_s"] = times.last_done
            return fut.value()

        return hook(inner, bucket).then(done)

    return timed_hook


class TorchTelemetryDDP(_Timed, nn.parallel.DistributedDataParallel):
    """torch's DDP with the same telemetry. Its reductions go through a timing comm hook wrapped
    around the default all-reduce, or around the script's own hook if it registers one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        clock = clock_for(next(self.module.parameters()).device)
        self.telemetry = StepTelemetry(clock=clock)
        self._comm = _CommTimes(clock)
        self._hooked = False

    def register_comm_hook(self, state: object, hook) -> None:
        if hook is allreduce_hook and state is None:
            state = self.process_group  # this module's group, as torch's reducer would use
        super().register_comm_hook((self._comm, state), _timed(hook))
        self._hooked = True

    def forward(self, *inputs, **kwargs):
        if not self._hooked:  # before the first backward, as torch requires
            self.register_comm_hook(None, allreduce_hook)
        if self.telemetry.trace is not None and self._comm.spans is None:
            self._comm.spans = []
        return self._timed_forward(super().forward, inputs, kwargs)

    def _bucket_spans(self) -> list[dict] | None:
        spans = self._comm.spans
        if not spans or not isinstance(self._comm.clock, HostClock):
            return None
        return [dict(s) for s in spans if "end_s" in s]

    def _comm_stats(self) -> tuple[Span | None, None]:
        c = self._comm
        if c.last_launch is None or c.last_done is None:
            return None, None
        return Span(c.last_launch, c.last_done), None
