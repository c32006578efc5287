"""The reducer: each synced backward's gradients averaged over ranks, bucket by bucket.

Read in the order of one step:
1. Setup: the wrapper arms the reducer at each synced forward (`prepare_for_backward`): each
   bucket begins its step and small-tensor gradients are preset as views (`_preset_grads`).
2. During backward: a post-accumulate-grad hook on every parameter moves the fresh gradient into
   its bucket view (`_on_grad_ready`). With gradient_as_bucket_view=True it makes `param.grad` that
   view, so the optimizer reads the reduced values with no copy back; with False (torch's default)
   `.grad` stays its own tensor and the reduced values are copied into it afterwards. When a
   bucket's last gradient arrives its reduction starts asynchronously while autograd goes on with
   earlier layers; buckets launch strictly in bucket order. The first gradient queues `_finalize`.
3. After backward (`_finalize`): parameters that got no gradient (an error unless
   find_unused_parameters or a static graph), what is left launched, sparse gradients reduced each
   on its own, which parameters were used on any rank agreed, every reduction waited for, the
   step's statistics recorded (stats.py) and handed to the observers once the clock can read
   them: at once on CPU, at a later step on a GPU, where nothing in the engine waits for the
   device (clock.py).

Sparse gradients (Embedding/EmbeddingBag with sparse=True) have no place in a flat buffer: each is
reduced on its own after backward (gloo all-reduces sparse tensors), or handed to the comm hook as
a bucket of its own, as torch does. With a static graph, the first synced backward only counts how
often each parameter receives a gradient (reentrant checkpointing gives some two); later ones
launch a bucket when every expected gradient has arrived.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from dpscale.comm.group_device import collective_device
from dpscale.engine.buckets import Bucket
from dpscale.engine.clock import Clock, EventClock, clock_for
from dpscale.engine.collective_log import CollectiveLog
from dpscale.engine.compat import torch_private
from dpscale.engine.grad_pool import GradPool, zero_views
from dpscale.engine.hooks import CommHook, GradBucket, checked_future
from dpscale.engine.noise_scale import bucket_sq_norm
from dpscale.engine.observers import GradNorms, GradNormTensors, StepObserver
from dpscale.engine.profiler_ranges import (
    EXPOSED_COMM,
    bucket_range_name,
    close_range,
    open_range,
    record_function,
)
from dpscale.engine.stats import BucketTiming, StepStats, StepWindow

# A bucket whose tensors average at most this many elements gets gradients accumulated in place
# (see Reducer._preset_grads): around here per-tensor Python work costs about what copying the
# tensor does (~5 us against 32 KiB at a few GB/s)
SMALL_TENSOR_NUMEL = 8192


class UnusedParametersError(RuntimeError):
    """Parameters got no gradient in a synchronized backward while find_unused_parameters is off.

    `names` lists them, so `dpscale run` can turn the error into advice from a record, not its text."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        shown = ", ".join(repr(n) for n in self.names[:5])
        more = f" and {len(self.names) - 5} more" if len(self.names) > 5 else ""
        super().__init__(
            f"parameters got no gradient in this backward pass: {shown}{more}. If they are "
            "unused in forward on purpose, construct DistributedDataParallel with "
            "find_unused_parameters=True; otherwise make sure every parameter takes part in "
            "computing the loss."
        )

    def __reduce__(self):  # pickles with its names (multirank returns a rank's exception to the parent)
        return (type(self), (self.names,))


class Reducer:
    """Reduces a model's gradients bucket by bucket during each synced backward."""

    # -- 1. setup: built once, re-bucketed by the autotuner, armed at each synced forward --------
    def __init__(
        self,
        params: list[torch.nn.Parameter],
        names: list[str],
        buckets: list[Bucket],
        process_group: dist.ProcessGroup | None,
        transport: Any,
        find_unused_parameters: bool,
        log: CollectiveLog | None = None,
        *,
        sparse: Sequence[int] = (),
        gradient_as_bucket_view: bool = True,
    ):
        self.params = params
        # True: .grad is a view into its bucket; False (torch's default): a tensor of its own
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.sparse_indices = list(sparse)
        self.dense_indices = [i for i in range(len(params)) if i not in set(sparse)]
        self.names = names
        self.process_group = process_group
        self.transport = transport
        self.world_size = dist.get_world_size(process_group)
        # what averaged gradients are divided by: the world size, or under Join with
        # divide_by_initial_world_size=False the number of ranks still training (see join.py)
        self.divisor = self.world_size
        self.static_graph = False
        self._counting = False  # static graph, first synced backward: count gradient arrivals
        self._arrivals: list[int] = [0] * len(params)
        self._expected: list[int] | None = None  # arrivals per backward, once counted
        self._warned_create_graph = False
        # the order gradients arrived in during the first synced backward (for the logging data)
        self.first_ready_order: list[int] | None = None
        self._order: list[int] | None = []
        self.last_backward_end_epoch_ns = 0
        self.find_unused_parameters = find_unused_parameters
        self.comm_hook: tuple[object, CommHook] | None = None
        self.log = log or CollectiveLog(process_group)
        self._comm_stream: torch.cuda.Stream | None = None
        if buckets and buckets[0].buffer.is_cuda:
            self._comm_stream = torch.cuda.Stream(device=buckets[0].buffer.device)
        # host time on CPU, events on the streams on CUDA (a test may pass another clock)
        self.clock: Clock = clock_for(buckets[0].buffer.device if buckets else None)
        # synced steps measured and not yet readable (events not complete): oldest first
        self._windows: deque[tuple[StepWindow, GradNormTensors | None]] = deque()
        self.buckets: list[Bucket] = []
        # where each parameter's gradient lives, indexed by parameter (None: sparse): (bucket,
        # position in the bucket, its view), looked up once per gradient by the hook
        self._slot: list[tuple[Bucket, int, torch.Tensor] | None] = []
        self.set_buckets(buckets)
        self._expecting = False
        self._ready = [False] * len(params)
        # which parameters got a gradient on this rank since the last synced backward, no_sync
        # micro-steps included: a parameter used only in a no_sync step still carries a local
        # gradient into the reduction, and every rank must then keep the reduced value (torch's
        # local_used_map does the same; judging by the synced step alone lets replicas drift)
        self._used_since_sync = [False] * len(params)
        self._preset = [False] * len(params)  # .grad is a view we set before this backward
        # gradient_as_bucket_view: .grad became its bucket view in a no_sync backward. torch's
        # reducer leaves .grad alone outside synced steps, so there it is still a tensor of its own
        # and is multiplied by 1/divisor at the sync, not divided in place (see _preset_grads)
        self._viewed_unsynced: set[int] = set()
        self._next_bucket = 0
        self._in_flight: list[Bucket] = []  # launched and not yet seen complete
        self._callback_queued = False
        self._t_forward_end: object = None
        self.last_stats: StepStats | None = None
        self._step = 0
        # who receives each synced step's measurements (observers.py); on the steps one of them
        # asks for, this rank's gradient norm is taken during backward (_measure_now)
        self.observers: list[StepObserver] = []
        self._measure_now = False
        # a torch.profiler records this step (set by the wrapper's forward): each bucket's
        # reduction and the wait after backward become ranges there (profiler_ranges.py)
        self.profiling = False
        self._ranges: dict[int, record_function] = {}  # by bucket index: launched, not seen complete
        self._handles = [
            p.register_post_accumulate_grad_hook(
                self._make_sparse_hook(i) if i in self.sparse_indices else self._make_hook(i)
            )
            for i, p in enumerate(params)
        ]

    # The hooks hold the reducer weakly. A strong reference would make a cycle through the
    # parameters' hook dicts that Python's collector cannot see into (torch keeps them on the C++
    # tensor), so an engine dropped without close() would keep its transport, and the shared
    # memory under its buckets, until the process ends. A dead reducer's hooks do nothing.
    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        reducer = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            self_ = reducer()
            if self_ is not None:
                self_._on_grad_ready(i, param)

        return hook

    def _make_sparse_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        reducer = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            self_ = reducer()
            if self_ is None:
                return
            # the sparse gradient stays in .grad (accumulated there by autograd); reduced in _finalize
            self_._used_since_sync[i] = True
            if self_._expecting:
                self_._mark_ready(i)

        return hook

    def set_buckets(self, buckets: list[Bucket]) -> None:
        """Use a new bucket layout from now on; gradients already accumulated move with it."""
        old = self.buckets
        self.buckets = buckets
        self._slot = [None] * len(self.params)
        for b in buckets:
            b.small = b.buffer.numel() <= SMALL_TENSOR_NUMEL * len(b.param_indices)
            b.members = [self.params[i] for i in b.param_indices]
            for pos, i in enumerate(b.param_indices):
                self._slot[i] = (b, pos, b.views[pos])
        if old is not buckets and self.gradient_as_bucket_view:
            for i, p in enumerate(self.params):
                if p.grad is not None:
                    slot = self._slot[i]
                    assert slot is not None, "a sparse parameter with gradient_as_bucket_view"
                    slot[2].copy_(p.grad)
                    p.grad = slot[2]

    @property
    def synced_steps(self) -> int:
        """Synced backwards done so far (the `StepStats.step` of the last one)."""
        return self._step

    def set_synced_steps(self, steps: int) -> None:
        """Count synced steps from `steps` (a resumed run's position): observers are then asked
        about the same steps as in a run that was never interrupted."""
        self._step = steps

    def prepare_for_backward(self, outputs: object = ()) -> None:
        """Arm the reducer: the next backward must reduce every bucket.

        `outputs` is accepted for code written against torch's reducer (Lightning's manual
        optimization, Accelerate's trigger_sync_in_backward call it); unused parameters are found
        after backward here, so it is not needed."""
        self._deliver_ready()  # what the device finished since: the last steps' stats
        self._expecting = True
        self._ready = [False] * len(self.params)
        for b in self.buckets:
            b.begin_step()
        if self.static_graph:
            self._counting = self._expected is None
            self._arrivals = [0] * len(self.params)
        self._next_bucket = 0
        self._in_flight = []
        self._callback_queued = False
        self._preset_grads()
        # One rank has no small/large pair to measure (its gradient is the average): no norms, no
        # cost. No observer: an empty list, nothing asked
        self._measure_now = (
            bool(self.observers)
            and self.world_size > 1
            and any(o.wants_grad_norms(self._step) for o in self.observers)
        )
        self._t_forward_end = self.clock.stamp()

    def _preset_grads(self) -> None:
        # In a bucket of small tensors, each parameter without a gradient gets its (zeroed) bucket
        # view as .grad before backward, so autograd accumulates into the bucket itself: no
        # gradient tensor to allocate, no copy and no per-parameter Python work in the hook, and
        # one division per bucket at launch. For small tensors that work is the engine's cost
        # (see benchmarks/per_parameter.py); for large ones, zeroing the bucket and adding into it
        # would cost more memory traffic than the copy-and-divide it saves, so they keep it.
        # A parameter that then gets no gradient anywhere is given None back after the reduction.
        # With gradient_as_bucket_view=False the same is done with the bucket's pool (GradPool).
        # The bucket's average at launch is torch's: its reducer multiplies a fresh gradient by
        # 1/divisor as it copies it into the bucket, but divides in place one that already is its
        # bucket view (gradient_as_bucket_view=True, a .grad kept from the last step). A bucket
        # whose gradients were all None before backward (zero_grad's default) is multiplied, one
        # with gradients kept as its views divided, a mix view by view (_divided_in_place).
        params, preset = self.params, self._preset
        for b in self.buckets:
            b.in_place = False
            if not b.small:
                continue
            missing = [k for k, p in enumerate(b.members) if p.grad is None]
            if self.gradient_as_bucket_view:
                b.in_place = self._divided_in_place(b, missing)
            if not missing:
                continue
            if self.gradient_as_bucket_view:
                grads = b.views
                zero_views(b.buffer, grads, missing)
            else:
                # torch's default, gradients apart from the bucket: views into the bucket's pool
                # (its copy of the same layout), copied into the bucket at launch and back after
                grads = self._pool(b, missing).views
            for k in missing:
                params[b.param_indices[k]].grad = grads[k]
                preset[b.param_indices[k]] = True

    def _divided_in_place(self, b: Bucket, missing: list[int]) -> bool | set[int]:
        """Which gradients of bucket `b` torch's reducer would divide in place (with
        gradient_as_bucket_view): those that are their bucket views from before this backward. It
        multiplies the others: None now (`missing`), or made views in a no_sync backward, where its
        .grad stays a tensor of its own (_viewed_unsynced). True: all, False: none, else their
        positions (a mix: some parameter unused in the last step, or a no_sync step first)."""
        n = len(b.param_indices)
        if not self._viewed_unsynced and len(missing) in (0, n):  # every step but odd ones
            return not missing
        unsynced, params = self._viewed_unsynced, self.params
        divided = {
            k for k, i in enumerate(b.param_indices) if params[i].grad is not None and i not in unsynced
        }
        return True if len(divided) == n else divided or False

    def _pool(self, b: Bucket, missing: list[int]) -> GradPool:
        """The bucket's pool with the views of `missing` zeroed; a new pool if anyone but us
        still holds one of the old one's gradients (a user keeping last step's .grad must find
        it unchanged, as with torch, where each step's gradients are new tensors)."""
        if b.pool is None or not b.pool.free():
            b.pool = GradPool(b.buffer, b.offsets, b.views)
            return b.pool
        return b.pool.zeroed(missing)

    def _rebuild_buckets(self) -> bool:
        """torch's reducer re-orders buckets once; callers only need to know none was rebuilt."""
        return False

    def disarm(self) -> None:
        """This forward's backward only accumulates locally (no_sync)."""
        self._expecting = False

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()

    def check_finalized(self) -> None:
        if self._expecting:
            raise RuntimeError(
                "the last synced forward was not followed by a backward that finished: call "
                "backward on its output (or run the forward under no_sync) before the next step"
            )

    # -- 2. during backward: autograd calls the hooks, full buckets are launched ----------------
    def _on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        slot = self._slot[i]
        assert slot is not None  # dense parameters only: sparse ones have their own hook
        bucket, pos, view = slot
        expecting = self._expecting
        more_to_come = expecting and self._count_arrival(i)
        # a bucket of large tensors is divided tensor by tensor, fused with the copy; one of
        # small tensors once, at launch (see _preset_grads)
        divide = not bucket.small and expecting and not more_to_come and self.comm_hook is None
        self._grad_into_view(i, param, view, divide, large=not bucket.small)
        self._used_since_sync[i] = True
        if not expecting:
            return
        if self._counting:
            self._ready[i] = True
            self._queue_finalize()
            return
        if more_to_come:
            return
        # what follows is _mark_ready(i) inlined, with its calls skipped where they would do
        # nothing: this runs once per gradient, and the per-tensor cost is benchmarked against torch
        if self._in_flight:
            self._stamp_completed()
        if self._ready[i]:
            self._raise_twice(i)
        self._ready[i] = True
        if self._order is not None:
            self._order.append(i)
        if not self._callback_queued:
            self._queue_finalize()
        if self._measure_now and not bucket.small:
            # the local norm, fused in cache with the copy-and-divide just above: the view was
            # written a moment ago, while a whole bucket read at launch would come from memory
            bucket.tensor_sq[pos] = bucket_sq_norm(view)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready_buckets()

    def _count_arrival(self, i: int) -> bool:
        """Static graph: count this arrival of parameter `i`'s gradient; whether more of its
        gradient is still to come in this backward (reentrant checkpointing)."""
        expected = self._expected
        if not (self._counting or (expected is not None and expected[i] > 1)):
            return False
        self._arrivals[i] += 1
        return self._counting or (expected is not None and self._arrivals[i] < expected[i])

    def _grad_into_view(
        self, i: int, param: torch.Tensor, view: torch.Tensor, divide: bool, *, large: bool
    ) -> None:
        """Parameter `i`'s fresh gradient into its bucket view (divided there if `divide`)."""
        grad = param.grad
        assert grad is not None  # a post-accumulate-grad hook runs with the gradient in place
        as_view = self.gradient_as_bucket_view
        if grad is not view and (not as_view or grad.data_ptr() != view.data_ptr()):
            if grad.requires_grad:  # backward(create_graph=True)
                grad = self._detached(param)
            # gradient_as_bucket_view=False (torch's default): .grad stays a tensor of its own
            # (accumulating locally under no_sync); its value goes into the bucket at a synced
            # step, here for a large tensor, at launch for a bucket of small ones (one call for
            # the bucket, see _gather_pool), and the reduced one comes back after the reduction
            # (_copy_out)
            if as_view or (self._expecting and large):
                self._copy_in(grad, view, divide)
            if as_view:
                # autograd's own tensor is freed here, as torch's reducer frees it (kept to the
                # next step, as before 2026-12-03, they sat beside the buckets at the peak and
                # saved no time one model per process: BENCHMARKS.md, "Spent gradients")
                param.grad = view
                if not self._expecting:
                    self._viewed_unsynced.add(i)
        elif divide:
            # autograd added into the view in place: it holds the local sum, divided now (an
            # in-place division, as torch's reducer does with a gradient that is its bucket view)
            self._divide_view(i, view)

    def _copy_in(self, grad: torch.Tensor, view: torch.Tensor, divide: bool) -> None:
        """`grad` into its bucket view, pre-divided in the same pass if `divide`: multiplied by
        1/divisor, as torch's reducer does (mul_out), so the averaged values are torch's bit for
        bit (x / 3 and x * (1/3) differ in the last bit for about a third of all x); and a vector
        multiplication costs half a division, which is compute-bound at these sizes."""
        if divide:
            torch.mul(grad, 1.0 / self.divisor, out=view)
        else:
            view.copy_(grad)

    def _divide_view(self, i: int, view: torch.Tensor) -> None:
        """The local sum already in parameter `i`'s bucket view, divided by the divisor as torch
        would: in place if .grad is the view in torch too, multiplied by 1/divisor if it became the
        view in a no_sync backward (torch's .grad is then a tensor of its own, copied by mul_out)."""
        if i in self._viewed_unsynced:
            view.mul_(1.0 / self.divisor)
        else:
            view.div_(self.divisor)

    def _detached(self, param: torch.Tensor) -> torch.Tensor:
        # torch DDP allows create_graph=True with a warning; the reduced gradient carries no graph
        if not self._warned_create_graph:
            self._warned_create_graph = True
            warnings.warn(
                "Using DistributedDataParallel with create_graph=True is not recommended: the "
                "reduced gradients in .grad are detached from the graph of the backward pass",
                stacklevel=4,
            )
        assert param.grad is not None
        param.grad = param.grad.detach()
        return param.grad

    def _queue_finalize(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch_private.queue_autograd_callback(self._finalize)

    def _mark_ready(self, i: int) -> None:
        self._stamp_completed()
        if self._ready[i]:
            self._raise_twice(i)
        self._ready[i] = True
        if self._order is not None:
            self._order.append(i)
        self._queue_finalize()

    def _raise_twice(self, i: int) -> None:
        raise RuntimeError(
            f"parameter {self.names[i]!r} received its gradient twice in one backward pass; "
            "dpscale reduces each gradient once per backward unless the graph is static: for "
            "reentrant checkpointing pass static_graph=True"
        )

    def _launch_ready_buckets(self) -> None:
        # Launch strictly in bucket order: collectives are matched by issue order across ranks,
        # so a rank must never reduce bucket 2 before bucket 1 even if its gradients came first.
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
            self._launch(self.buckets[self._next_bucket])
            self._next_bucket += 1

    def _launch(self, bucket: Bucket) -> None:
        timing = bucket.timing
        assert timing is not None  # set by begin_step
        t_host = time.perf_counter()
        if self._comm_stream is not None:
            # the bucket was filled on the compute stream; communication must see those writes
            self._comm_stream.wait_stream(torch.cuda.current_stream(bucket.buffer.device))
            with torch.cuda.stream(self._comm_stream):
                timing.start = self.clock.stamp(self._comm_stream)
                fut = self._start_reduction(bucket)
        else:
            timing.start = self.clock.stamp()
            fut = self._start_reduction(bucket)
        bucket.future = fut
        if self.profiling:
            self._ranges[bucket.index] = open_range(bucket_range_name(bucket.index))
        if isinstance(self.clock, EventClock):
            # NCCL marks the future done once the collective is enqueued; its callback runs with
            # the current stream made to wait for the reduction, so an event there marks its end
            fut.then(partial(_stamp_end, self.clock, timing))
        else:
            self._in_flight.append(bucket)
            self._stamp_completed()  # a synchronous transport (shm) is done already
        # A synchronous transport (shm) reduces inside this call, on the thread that runs
        # backward: that time is not overlapped with compute, whatever the timestamps say.
        if self.clock.launch_holds_compute:
            timing.blocking_ms = (time.perf_counter() - t_host) * 1e3

    def _start_reduction(self, bucket: Bucket) -> torch.Future:
        if bucket.small:
            if not self.gradient_as_bucket_view:
                self._gather_grads(bucket)
            if self.comm_hook is None and self.divisor != 1:
                self._average_small(bucket)
        if self._measure_now:
            self._measure_local(bucket)
        return self._reduce(bucket)

    def _gather_grads(self, bucket: Bucket) -> None:
        """gradient_as_bucket_view=False: a small bucket's gradients, apart from it (see
        _preset_grads), go into it: one copy of the pool when they are its views."""
        grads = [p.grad for p in bucket.members]
        pool = bucket.pool
        gaps = None if pool is None else pool.gaps(grads)
        if pool is not None and gaps is not None:
            bucket.buffer.copy_(pool.flat)
            for k in gaps:  # .grad set to None after forward: the pool's view may be stale
                bucket.views[k].zero_()
            return
        for view, grad in zip(bucket.views, grads, strict=True):
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad)

    def _average_small(self, bucket: Bucket) -> None:
        """The views hold local sums: average once per bucket, as torch's reducer would have
        tensor by tensor (see _preset_grads)."""
        in_place = bucket.in_place
        if in_place is True:
            bucket.buffer.div_(self.divisor)
        elif not in_place:
            bucket.buffer.mul_(1.0 / self.divisor)
        else:  # a mix, view by view
            for k, view in enumerate(bucket.views):
                if k in in_place:
                    view.div_(self.divisor)
                else:
                    view.mul_(1.0 / self.divisor)

    def _measure_local(self, bucket: Bucket) -> None:
        # this rank's gradient after the division (divided by the divisor without a hook,
        # undivided with one: the hook contract): a small bucket read now (still in cache after
        # its division); a bucket of large tensors from the norms its tensors got as they
        # arrived, and now for those that never passed the hook in this backward (unused here,
        # the counting backward of a static graph)
        if bucket.small:
            bucket.local_sq = bucket_sq_norm(bucket.buffer)
            return
        parts = bucket.tensor_sq
        for pos, view in enumerate(bucket.views):
            if pos not in parts:
                parts[pos] = bucket_sq_norm(view)
        bucket.local_sq = torch.stack(list(parts.values())).sum()

    def _reduce(self, bucket: Bucket) -> torch.Future:
        # a hook issues its own collectives, but recording it here still shows where a rank was
        op = "all_reduce" if self.comm_hook is None else "comm_hook"
        self.log.record(op, f"bucket {bucket.index}", bucket.buffer, bucket=bucket.index)
        if self.comm_hook is None:
            return self.transport.all_reduce(bucket.buffer)
        state, hook = self.comm_hook
        grad_bucket = GradBucket(
            bucket.index,
            bucket.buffer,
            bucket.members,
            bucket.views,
            bucket.offsets,
            is_last=bucket.index == len(self.buckets) - 1,
        )
        return checked_future(hook(state, grad_bucket))

    def _stamp_completed(self) -> None:
        # When each reduction finished, for the step's statistics. Polled from the autograd thread
        # (at every gradient, after backward, while waiting) rather than by a done-callback, which
        # would run on the transport's thread and fight backward for the GIL; so a time is exact
        # to within one gradient's interval during backward and exact afterwards.
        if self._in_flight:
            now, still = self.clock.stamp(), []
            for b in self._in_flight:
                assert b.future is not None and b.timing is not None
                if b.future.done():
                    b.timing.end = now
                    if self._ranges:
                        close_range(self._ranges.pop(b.index))
                else:
                    still.append(b)
            self._in_flight = still

    # -- 3. after backward: what was not launched, sparse gradients, the wait, the statistics ---
    def _finalize(self) -> None:
        """Runs once per synced backward, after autograd has produced every gradient."""
        self._expecting = False
        t_backward_end = self.clock.stamp()
        self.last_backward_end_epoch_ns = time.time_ns()
        if self._order is not None:
            self.first_ready_order, self._order = self._order, None
        if self._counting:
            self._end_counting()
        allow_unused = self.find_unused_parameters or self.static_graph
        # a bucket launches once its last gradient is in: with every bucket launched, none is missing
        launched_all = self._next_bucket == len(self.buckets)
        missing = [] if launched_all else [i for i in self.dense_indices if not self._ready[i]]
        missing_sparse = [i for i in self.sparse_indices if not self._ready[i]]
        if (missing or missing_sparse) and not allow_unused:
            self._abort_launched()
            self._raise_unused(missing + missing_sparse)
        had_grad = self._fill_missing(missing)
        self._launch_ready_buckets()
        sparse_futures = [self._reduce_sparse(i, k) for k, i in enumerate(self.sparse_indices)]
        # every rank must issue this collective, also one that saw every gradient
        had_grad.update({i: self.params[i].grad is not None for i in missing_sparse})
        used = self._globally_used(missing + missing_sparse) if allow_unused else {}
        self._used_since_sync = [False] * len(self.params)
        exposed = open_range(EXPOSED_COMM) if self.profiling else None
        self._wait_all()
        results = [fut.wait() for fut in sparse_futures]
        # every reduction is over (on CUDA: the stream waits for them, see _wait_all): what
        # follows (gradients into .grad, norms) is not communication
        t_done = self.clock.stamp()
        if exposed is not None:
            close_range(exposed)
        for i, result in zip(self.sparse_indices, results, strict=True):
            result = result[0] if isinstance(result, list) else result
            if self._ready[i] or had_grad[i] or used[i]:
                self.params[i].grad = result
        self._hand_back_missing(missing, had_grad, used)
        self._preset = [False] * len(self.params)
        self._viewed_unsynced.clear()
        if not self.gradient_as_bucket_view:
            self._copy_out()
        self._record_stats(t_backward_end, t_done, self._grad_norms())

    def _raise_unused(self, missing: list[int]) -> None:
        raise UnusedParametersError([self.names[i] for i in missing])

    def _fill_missing(self, missing: list[int]) -> dict[int, bool]:
        """The bucket views of dense parameters that got no gradient in this backward: their
        local value (zero, or what no_sync steps accumulated); whether each had a gradient."""
        had_grad = {}
        for i in missing:
            slot = self._slot[i]
            assert slot is not None
            bucket, _, view = slot
            p = self.params[i]
            # a gradient of the user's (accumulated in no_sync steps), not the zeros we preset
            had_grad[i] = p.grad is not None and not self._preset[i]
            # a local accumulated sum, undivided so far (a bucket of small tensors: at launch)
            divide = self.comm_hook is None and not bucket.small
            if p.grad is None:
                view.zero_()  # contributes nothing from this rank
            elif p.grad is not view and p.grad.data_ptr() != view.data_ptr():
                self._copy_in(p.grad, view, divide)
            elif divide:
                self._divide_view(i, view)
            bucket.pending -= 1
        return had_grad

    def _hand_back_missing(
        self, missing: list[int], had_grad: dict[int, bool], used: dict[int, bool]
    ) -> None:
        """After the reduction: a parameter used on some rank gets the averaged gradient; one
        unused everywhere keeps what it had (None if we preset it)."""
        for i in missing:
            slot = self._slot[i]
            assert slot is not None
            view = slot[2]
            p = self.params[i]
            if had_grad[i] or used[i]:
                if p.grad is None or self.gradient_as_bucket_view:
                    p.grad = view
                # else: a tensor of its own, which _copy_out fills
            elif self._preset[i]:
                p.grad = None  # unused everywhere: as if we had never set it

    def _copy_out(self) -> None:
        """gradient_as_bucket_view=False: the reduced values into each .grad, a tensor apart
        from the bucket as in torch (the bucket is overwritten by the next step's reduction):
        one copy per bucket of small tensors (its pool, see grad_pool.py), one fused copy
        for the other gradients."""
        own, reduced = [], []
        for b in self.buckets:
            if b.pool is not None and b.pool.gaps([p.grad for p in b.members]) is not None:
                b.pool.flat.copy_(b.buffer)
                continue
            for p, view in zip(b.members, b.views, strict=True):
                grad = p.grad
                if grad is None:
                    continue
                if grad is view:  # used only on other ranks: no gradient of its own yet
                    p.grad = view.clone()
                else:
                    own.append(grad)
                    reduced.append(view)
        if own:
            torch_private.foreach_copy_(own, reduced)

    def _grad_norms(self) -> GradNormTensors | None:
        """This rank's local |g|^2 and, if an observer wants it, the averaged |G|^2, over the
        dense buckets, as float64 tensors on the device (read later: no sync); None on a step
        that measured nothing."""
        local_sq = [b.local_sq for b in self.buckets]
        if not self._measure_now or not self.buckets or any(sq is None for sq in local_sq):
            return None
        # without a hook the buffers were divided by the divisor before the reduction
        scale = 1.0 if self.comm_hook is not None else float(self.divisor) ** 2
        local = torch.stack(local_sq).sum().double() * scale  # type: ignore[arg-type]
        for b in self.buckets:
            b.local_sq = None
        reduced = None
        if any(o.wants_reduced_norm for o in self.observers):
            reduced = torch.stack([bucket_sq_norm(b.buffer) for b in self.buckets]).sum().double()
        return GradNormTensors(local, reduced, self.world_size, all_ranks=self.divisor == self.world_size)

    def _end_counting(self) -> None:
        # the counting backward launched nothing yet and divided nothing
        self._counting = False
        self._expected = list(self._arrivals)
        for i in self.dense_indices:
            if self._ready[i]:
                slot = self._slot[i]
                assert slot is not None
                bucket, _, view = slot
                if self.comm_hook is None and not bucket.small:
                    # large tensors: divided per tensor, as the hook's copy would have
                    view.mul_(1.0 / self.divisor)
                bucket.pending -= 1

    def _reduce_sparse(self, i: int, k: int) -> torch.Future:
        p = self.params[i]
        grad = p.grad
        if grad is None:  # unused on this rank: contributes nothing
            grad = torch.sparse_coo_tensor(
                torch.empty(1, 0, dtype=torch.long, device=p.device),
                torch.empty(0, *p.shape[1:], dtype=p.dtype, device=p.device),
                p.shape,
            )
        grad = grad.coalesce()
        self.log.record("all_reduce", f"sparse gradient of {self.names[i]}")
        if self.comm_hook is not None:
            state, hook = self.comm_hook
            index = len(self.buckets) + k
            is_last = k == len(self.sparse_indices) - 1
            return checked_future(hook(state, GradBucket(index, grad, [p], [grad], [0], is_last=is_last)))
        grad = grad / self.divisor
        work = dist.all_reduce(grad, group=self.process_group, async_op=True)
        assert work is not None
        return work.get_future()

    def _globally_used(self, missing: list[int]) -> dict[int, bool]:
        # A parameter unused here may be used on another rank (or on this one in a no_sync step);
        # its averaged gradient then is real and must reach the optimizer on every rank. Unused
        # everywhere since the last sync: leave .grad as it was.
        device = collective_device(self.process_group)
        local = torch.tensor(self._used_since_sync, dtype=torch.int32, device=device)
        self.log.record("all_reduce", "used-parameter flags", local)
        dist.all_reduce(local, group=self.process_group)
        return {i: bool(local[i]) for i in missing}

    def _wait_all(self) -> None:
        self._stamp_completed()
        for bucket in self.buckets:
            assert bucket.future is not None  # every bucket is launched before the wait
            result = bucket.future.wait()
            self._stamp_completed()
            if self._ranges and bucket.index in self._ranges:  # events time it on CUDA: done here
                close_range(self._ranges.pop(bucket.index))
            if isinstance(result, list):  # a Work's future yields the list of tensors
                result = result[0]
            if result is not bucket.buffer and result.data_ptr() != bucket.buffer.data_ptr():
                bucket.buffer.copy_(result)
        if self._comm_stream is not None:
            torch.cuda.current_stream(self.buckets[0].buffer.device).wait_stream(self._comm_stream)

    def _abort_launched(self) -> None:
        # wait for what is in flight so buffers are not written while the error propagates
        for b in self.buckets:
            if b.future is not None:
                b.future.wait()
        for r in self._ranges.values():
            close_range(r)
        self._ranges.clear()

    def _record_stats(self, t_backward_end: object, t_done: object, norms: GradNormTensors | None) -> None:
        timings: list[BucketTiming] = [b.timing for b in self.buckets if b.timing is not None]
        self._step += 1
        window = StepWindow(self._step, self._t_forward_end, t_backward_end, t_done, timings)
        if norms is not None:
            for observer in self.observers:
                observer.on_grad_norms(self._step, norms)
            pair = [norms.local_sq, norms.local_sq if norms.reduced_sq is None else norms.reduced_sq]
            window.norms = self.clock.to_host(torch.stack(pair))
        self._windows.append((window, norms))
        self._deliver_ready()

    def _deliver_ready(self) -> None:
        """The measured steps the clock can read now, oldest first, to `last_stats` and the
        observers; a step whose events are not complete waits for a later call (no sync)."""
        windows = self._windows
        while windows and windows[0][0].ready(self.clock):
            window, tensors = windows.popleft()
            stats = StepStats.from_window(window, self.clock)
            norms = None
            if tensors is not None and window.norms is not None:
                local, reduced = window.norms.values()
                reduced_sq = None if tensors.reduced_sq is None else reduced
                norms = GradNorms(local, reduced_sq, tensors.world_size, tensors.all_ranks)
                stats.grad_sq_norm_local, stats.grad_sq_norm_global = norms.local_sq, norms.reduced_sq
            self.last_stats = stats
            for observer in self.observers:
                observer.on_step(stats, norms)


def _stamp_end(clock: Clock, timing: BucketTiming, fut: torch.Future) -> None:
    # a future's callback: on CUDA the current stream here waits for the reduction
    timing.end = clock.stamp()
