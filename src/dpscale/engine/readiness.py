"""During backward: each gradient into its bucket, and each bucket reduced once its last gradient is in.

`Reducer`'s autograd side (its state is set up in reducer.py). A post-accumulate-grad hook on every
parameter moves the fresh gradient into its bucket view. With gradient_as_bucket_view=True it
makes `param.grad` that view, so the optimizer reads the reduced values with no copy back; with
False (torch's default) `.grad` stays its own tensor and finalize.py copies the reduced values
into it. When a bucket's last gradient arrives, its
reduction starts asynchronously while autograd goes on with earlier layers; buckets launch strictly
in bucket order. The first gradient of a synced backward queues `_finalize` (finalize.py) on the
autograd engine. Sparse gradients stay in `.grad` and are only marked ready here.
"""

from __future__ import annotations

import time
import warnings
import weakref

import torch

from dpscale.engine.buckets import Bucket
from dpscale.engine.hooks import GradBucket, checked_future
from dpscale.engine.noise_scale import bucket_sq_norm


class Readiness:
    """The hooks autograd calls and the launch of bucket reductions; mixed into `Reducer`."""

    # The hooks hold the reducer weakly. A strong reference would make a cycle through the
    # parameters' hook dicts that Python's collector cannot see into (torch keeps them on the C++
    # tensor), so an engine dropped without close() would keep its transport, and the shared
    # memory under its buckets, until the process ends. A dead reducer's hooks do nothing.
    def _make_hook(self, i: int):
        reducer = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            self_ = reducer()
            if self_ is not None:
                self_._on_grad_ready(i, param)

        return hook

    def _make_sparse_hook(self, i: int):
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

    def _on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        bucket, pos, view, small = self._slot[i]
        grad = param.grad
        expecting = self._expecting
        more_to_come = False  # static graph: this gradient arrives again in this backward
        if expecting and (self._counting or (self._expected is not None and self._expected[i] > 1)):
            self._arrivals[i] += 1
            more_to_come = self._counting or self._arrivals[i] < self._expected[i]
        # a bucket of large tensors is divided tensor by tensor, fused with the copy; one of
        # small tensors once, at launch (see _preset_grads)
        divide = not small and expecting and not more_to_come and self.comm_hook is None
        as_view = self.gradient_as_bucket_view
        if grad is not view and (not as_view or grad.data_ptr() != view.data_ptr()):
            if grad.requires_grad:  # backward(create_graph=True)
                grad = self._detached(param)
            # gradient_as_bucket_view=False (torch's default): .grad stays a tensor of its own
            # (accumulating locally under no_sync); its value goes into the bucket at a synced
            # step, here for a large tensor, at launch for a bucket of small ones (one call for
            # the bucket, see _start_reduction), and the reduced one comes back after the
            # reduction (Finalize._copy_out)
            if as_view or (expecting and not small):
                self._copy_in(grad, view, divide)
            if as_view:
                param.grad = view
                self._spent.append(grad)
                if not expecting:
                    self._viewed_unsynced.add(i)
        elif divide:
            # autograd added into the view in place: it holds the local sum, divided now (an
            # in-place division, as torch's reducer does with a gradient that is its bucket view)
            self._divide_view(i, view)
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
        if self._measure_now and not small:
            # the local norm, fused in cache with the copy-and-divide just above: the view was
            # written a moment ago, while a whole bucket read at launch would come from memory
            self._tensor_sq[bucket.index][pos] = bucket_sq_norm(view)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready_buckets()

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
                stacklevel=3,
            )
        param.grad = param.grad.detach()
        return param.grad

    def _queue_finalize(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

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
        if not self.gradient_as_bucket_view and self._small[bucket.index]:
            # gradients apart from the bucket (see _preset_grads) go into it: one copy of the pool
            grads = [p.grad for p in self._members[bucket.index]]
            pool = self._pools[bucket.index]
            gaps = None if pool is None else pool.gaps(grads)
            if gaps is not None:
                bucket.buffer.copy_(pool.flat)
                for k in gaps:  # .grad set to None after forward: the pool's view may be stale
                    bucket.views[k].zero_()
            else:
                for view, grad in zip(bucket.views, grads, strict=True):
                    if grad is None:
                        view.zero_()
                    else:
                        view.copy_(grad)
        if self.comm_hook is None and self.divisor != 1 and self._small[bucket.index]:
            # the views hold local sums: average once per bucket, as torch's reducer would have
            # tensor by tensor (see _preset_grads)
            in_place = self._in_place[bucket.index]
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
        if self._measure_now:
            # this rank's gradient after the division (divided by the divisor without a hook,
            # undivided with one: the hook contract): a small bucket read now (still in cache after
            # its division); a bucket of large tensors from the norms its tensors got as they
            # arrived, and now for those that never passed the hook in this backward (unused here,
            # the counting backward of a static graph)
            if self._small[bucket.index]:
                self._local_sq.append(bucket_sq_norm(bucket.buffer))
            else:
                parts = self._tensor_sq[bucket.index]
                for pos, view in enumerate(bucket.views):
                    if pos not in parts:
                        parts[pos] = bucket_sq_norm(view)
                self._local_sq.append(torch.stack(list(parts.values())).sum())
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
        return checked_future(hook(state, grad_bucket))
