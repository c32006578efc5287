"""Readiness tracking: launch each bucket's reduction as soon as its last gradient is ready.

A post-accumulate-grad hook on every parameter moves the fresh gradient into its bucket view
(and makes `param.grad` that view, so the optimizer reads the reduced values with no copy back).
When a bucket's last gradient arrives, its reduction starts asynchronously while autograd goes on
with earlier layers. A callback queued on the autograd engine runs once backward is over: it
handles parameters that got no gradient, launches what is left, and waits for all reductions.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .buckets import Bucket
from .collective_log import CollectiveLog
from .hooks import CommHook, GradBucket
from .stats import BucketTiming, StepStats


class Reducer:
    def __init__(
        self,
        params: list[torch.nn.Parameter],
        names: list[str],
        buckets: list[Bucket],
        process_group: dist.ProcessGroup | None,
        transport,
        find_unused_parameters: bool,
        log: CollectiveLog | None = None,
    ):
        self.params = params
        self.names = names
        self.process_group = process_group
        self.transport = transport
        self.world_size = dist.get_world_size(process_group)
        self.find_unused_parameters = find_unused_parameters
        self.comm_hook: tuple[object, CommHook] | None = None
        self.log = log or CollectiveLog(process_group)
        self._comm_stream = None
        if buckets and buckets[0].buffer.is_cuda:
            self._comm_stream = torch.cuda.Stream(device=buckets[0].buffer.device)
        self.set_buckets(buckets)
        self._expecting = False
        self._ready = [False] * len(params)
        # which parameters got a gradient on this rank since the last synced backward, no_sync
        # micro-steps included: a parameter used only in a no_sync step still carries a local
        # gradient into the reduction, and every rank must then keep the reduced value (torch's
        # local_used_map does the same; judging by the synced step alone lets replicas drift)
        self._used_since_sync = [False] * len(params)
        self._next_bucket = 0
        self._futures: list[torch.futures.Future | None] = [None] * len(buckets)
        self._timings: list[BucketTiming] = []
        self._in_flight: list[int] = []  # buckets launched and not yet seen complete
        self._callback_queued = False
        self._spent: list[torch.Tensor] = []
        self._t_forward_end = 0.0
        self.last_stats: StepStats | None = None
        self._step = 0
        self._handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(params)
        ]

    # -- called by the wrapper -------------------------------------------------------------
    def set_buckets(self, buckets: list[Bucket]) -> None:
        """Use a new bucket layout from now on; gradients already accumulated move with it."""
        old = getattr(self, "buckets", None)
        self.buckets = buckets
        # where each parameter's gradient lives: (bucket, position in bucket)
        self._slot = {i: (b, pos) for b in buckets for pos, i in enumerate(b.param_indices)}
        if old is not buckets:
            for i, p in enumerate(self.params):
                if p.grad is not None:
                    bucket, pos = self._slot[i]
                    bucket.views[pos].copy_(p.grad)
                    p.grad = bucket.views[pos]
        self._futures = [None] * len(buckets)

    def prepare_for_backward(self) -> None:
        """Arm the reducer: the next backward must reduce every bucket."""
        self._release_spent()
        self._expecting = True
        self._ready = [False] * len(self.params)
        for b in self.buckets:
            b.pending = len(b.param_indices)
        self._next_bucket = 0
        self._futures = [None] * len(self.buckets)
        self._timings = [BucketTiming(b.index, b.nbytes) for b in self.buckets]
        self._in_flight = []
        self._callback_queued = False
        self._t_forward_end = time.perf_counter()

    def _release_spent(self) -> None:
        # Autograd's own gradient tensors, already copied into the buckets, are freed here, at the
        # start of the next step, rather than one by one in the middle of backward: freeing large
        # blocks while backward still allocates lets the C allocator hand pages back to the OS and
        # fault them in again (measured: ~10,000 page faults and several ms per transformer step).
        # Freed here, they are reused like the gradients of a model without DDP.
        self._spent.clear()

    def disarm(self) -> None:
        """This forward's backward only accumulates locally (no_sync)."""
        self._expecting = False

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()

    # -- autograd side ---------------------------------------------------------------------
    def _make_hook(self, i: int):
        def hook(param: torch.Tensor) -> None:
            self._on_grad_ready(i, param)

        return hook

    def _on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        bucket, pos = self._slot[i]
        view = bucket.views[pos]
        grad = param.grad
        fast_path = self._expecting and self.comm_hook is None
        if grad.data_ptr() == view.data_ptr():
            # autograd added into the view in place (accumulation): the view holds the local sum,
            # to be divided before the reduction (views in one bucket may differ in this)
            if fast_path:
                view.div_(self.world_size)
        else:
            if fast_path:
                # copy and pre-divide in one pass over the gradient
                torch.div(grad, self.world_size, out=view)
            else:
                view.copy_(grad)
            param.grad = view
            self._spent.append(grad)
        self._used_since_sync[i] = True
        if not self._expecting:
            return
        self._stamp_completed()
        if self._ready[i]:
            raise RuntimeError(
                f"parameter {self.names[i]!r} received its gradient twice in one backward pass; "
                "dpscale reduces each gradient once per backward (reentrant checkpointing or a "
                "second backward through the same graph is not supported with synchronization on)"
            )
        self._ready[i] = True
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        # Launch strictly in bucket order: collectives are matched by issue order across ranks,
        # so a rank must never reduce bucket 2 before bucket 1 even if its gradients came first.
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
            self._launch(self.buckets[self._next_bucket])
            self._next_bucket += 1

    def _launch(self, bucket: Bucket) -> None:
        timing = self._timings[bucket.index]
        timing.start_s = time.perf_counter()
        if self._comm_stream is not None:
            # the bucket was filled on the compute stream; communication must see those writes
            self._comm_stream.wait_stream(torch.cuda.current_stream(bucket.buffer.device))
            with torch.cuda.stream(self._comm_stream):
                fut = self._start_reduction(bucket)
        else:
            fut = self._start_reduction(bucket)
        self._futures[bucket.index] = fut
        self._in_flight.append(bucket.index)
        self._stamp_completed()  # a synchronous transport (shm) is done already
        # A synchronous transport (shm) reduces inside this call, on the thread that runs
        # backward: that time is not overlapped with compute, whatever the timestamps say.
        timing.blocking_s = time.perf_counter() - timing.start_s

    def _start_reduction(self, bucket: Bucket) -> torch.futures.Future:
        # a hook issues its own collectives, but recording it here still shows where a rank was
        op = "all_reduce" if self.comm_hook is None else "comm_hook"
        self.log.record(op, f"bucket {bucket.index}", bucket.buffer, bucket=bucket.index)
        if self.comm_hook is None:
            return self.transport.all_reduce(bucket.buffer)
        state, hook = self.comm_hook
        params = [self.params[i] for i in bucket.param_indices]
        grad_bucket = GradBucket(
            bucket.index,
            bucket.buffer,
            params,
            bucket.views,
            bucket.offsets,
            is_last=bucket.index == len(self.buckets) - 1,
        )
        return hook(state, grad_bucket)

    def _finalize(self) -> None:
        """Runs once per synced backward, after autograd has produced every gradient."""
        self._expecting = False
        t_backward_end = time.perf_counter()
        missing = [i for i, r in enumerate(self._ready) if not r]
        if missing and not self.find_unused_parameters:
            self._abort_launched()
            names = ", ".join(repr(self.names[i]) for i in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise RuntimeError(
                f"parameters got no gradient in this backward pass: {names}{more}. If they are "
                "unused in forward on purpose, construct DistributedDataParallel with "
                "find_unused_parameters=True; otherwise make sure every parameter takes part in "
                "computing the loss."
            )
        had_grad = {i: self.params[i].grad is not None for i in missing}
        for i in missing:
            bucket, pos = self._slot[i]
            p, view = self.params[i], bucket.views[pos]
            if p.grad is None:
                view.zero_()  # contributes nothing from this rank
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            if p.grad is not None and self.comm_hook is None:
                view.div_(self.world_size)  # a local accumulated sum, undivided so far
            bucket.pending -= 1
        self._launch_ready_buckets()
        # every rank must issue this collective, also one that saw every gradient
        used = self._globally_used(missing) if self.find_unused_parameters else {}
        self._used_since_sync = [False] * len(self.params)
        self._wait_all()
        for i in missing:
            bucket, pos = self._slot[i]
            if had_grad[i] or used[i]:
                self.params[i].grad = bucket.views[pos]
        self._record_stats(t_backward_end)

    def _globally_used(self, missing: list[int]) -> dict[int, bool]:
        # A parameter unused here may be used on another rank (or on this one in a no_sync step);
        # its averaged gradient then is real and must reach the optimizer on every rank. Unused
        # everywhere since the last sync: leave .grad as it was.
        # on the buckets' device: NCCL reduces CUDA tensors only
        device = self.buckets[0].buffer.device if self.buckets else torch.device("cpu")
        local = torch.tensor(self._used_since_sync, dtype=torch.int32, device=device)
        self.log.record("all_reduce", "used-parameter flags", local)
        dist.all_reduce(local, group=self.process_group)
        return {i: bool(local[i]) for i in missing}

    def _stamp_completed(self) -> None:
        # When each reduction finished, for the step's statistics. Polled from the autograd thread
        # (at every gradient, after backward, while waiting) rather than by a done-callback, which
        # would run on the transport's thread and fight backward for the GIL; so a time is exact
        # to within one gradient's interval during backward and exact afterwards.
        if self._in_flight:
            now, still = time.perf_counter(), []
            for b in self._in_flight:
                if self._futures[b].done():
                    self._timings[b].end_s = now
                else:
                    still.append(b)
            self._in_flight = still

    def _wait_all(self) -> None:
        self._stamp_completed()
        for bucket, fut in zip(self.buckets, self._futures, strict=True):
            result = fut.wait()
            self._stamp_completed()
            if isinstance(result, list):  # a Work's future yields the list of tensors
                result = result[0]
            if result is not bucket.buffer and result.data_ptr() != bucket.buffer.data_ptr():
                bucket.buffer.copy_(result)
        if self._comm_stream is not None:
            torch.cuda.current_stream(self.buckets[0].buffer.device).wait_stream(self._comm_stream)

    def _abort_launched(self) -> None:
        # wait for what is in flight so buffers are not written while the error propagates
        for fut in self._futures:
            if fut is not None:
                fut.wait()

    def _record_stats(self, t_backward_end: float) -> None:
        t_done = time.perf_counter()
        for t in self._timings:  # on CUDA the host sees completion only when waiting
            t.end_s = t.end_s or t_done
        self._step += 1
        self.last_stats = StepStats.from_timings(
            step=self._step,
            t0=self._t_forward_end,
            t_backward_end=t_backward_end,
            t_done=t_done,
            timings=self._timings,
        )
