"""Readiness tracking: launch each bucket's reduction as soon as its last gradient is ready.

A post-accumulate-grad hook on every parameter moves the fresh gradient into its bucket view
(and makes `param.grad` that view, so the optimizer reads the reduced values with no copy back).
When a bucket's last gradient arrives, its reduction starts asynchronously while autograd goes on
with earlier layers. A callback queued on the autograd engine runs once backward is over: it
handles parameters that got no gradient, launches what is left, and waits for all reductions.

Sparse gradients (Embedding/EmbeddingBag with sparse=True) have no place in a flat buffer: each is
reduced on its own after backward (gloo all-reduces sparse tensors), or handed to the comm hook as
a bucket of its own, as torch does. With a static graph, the first synced backward only counts how
often each parameter receives a gradient (reentrant checkpointing gives some two); later ones
launch a bucket when every expected gradient has arrived.
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist

from .buckets import Bucket
from .collective_log import CollectiveLog
from .hooks import CommHook, GradBucket
from .noise_scale import NoiseScaleEstimator, bucket_sq_norm
from .stats import BucketTiming, StepStats

# A bucket whose tensors average at most this many elements gets gradients accumulated in place
# (see Reducer._preset_grads): around here per-tensor Python work costs about what copying the
# tensor does (~5 us against 32 KiB at a few GB/s)
SMALL_TENSOR_NUMEL = 8192


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
        *,
        sparse: list[int] = (),
    ):
        self.params = params
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
        self._preset = [False] * len(params)  # .grad is a view we set before this backward
        self._next_bucket = 0
        self._futures: list[torch.futures.Future | None] = [None] * len(buckets)
        self._timings: list[BucketTiming] = []
        self._in_flight: list[int] = []  # buckets launched and not yet seen complete
        self._callback_queued = False
        self._spent: list[torch.Tensor] = []
        self._t_forward_end = 0.0
        self.last_stats: StepStats | None = None
        self._step = 0
        # gradient noise scale (noise_scale.py): this rank's squared gradient norm before the
        # reduction and the averaged one after; units of one rank's batch (B_big/B_small = W)
        self.measure_noise_scale = True
        # measure on every this many synced steps: each measurement reads every gradient twice, 3.7%
        # of an mlp step at 2 workers on a loaded 2-core host (benchmarks/noise_scale_cost.py)
        self.noise_scale_every = 8
        self._measure_now = False
        self.noise_scale = NoiseScaleEstimator()
        self._local_sq: list[torch.Tensor] = []
        self._handles = [
            p.register_post_accumulate_grad_hook(
                self._make_sparse_hook(i) if i in self.sparse_indices else self._make_hook(i)
            )
            for i, p in enumerate(params)
        ]

    # -- called by the wrapper -------------------------------------------------------------
    def set_buckets(self, buckets: list[Bucket]) -> None:
        """Use a new bucket layout from now on; gradients already accumulated move with it."""
        old = getattr(self, "buckets", None)
        self.buckets = buckets
        # where each parameter's gradient lives: (bucket, position in bucket)
        self._slot = {i: (b, pos) for b in buckets for pos, i in enumerate(b.param_indices)}
        self._small = [b.buffer.numel() <= SMALL_TENSOR_NUMEL * len(b.param_indices) for b in buckets]
        if old is not buckets:
            for i, p in enumerate(self.params):
                if p.grad is not None:
                    bucket, pos = self._slot[i]
                    bucket.views[pos].copy_(p.grad)
                    p.grad = bucket.views[pos]
        self._futures = [None] * len(buckets)

    def set_synced_steps(self, steps: int) -> None:
        """Count synced steps from `steps` (a resumed run's position): the noise scale is then
        measured on the same steps as in a run that was never interrupted."""
        self._step = steps

    def prepare_for_backward(self, outputs=()) -> None:
        """Arm the reducer: the next backward must reduce every bucket.

        `outputs` is accepted for code written against torch's reducer (Lightning's manual
        optimization, Accelerate's trigger_sync_in_backward call it); unused parameters are found
        after backward here, so it is not needed."""
        self.release_spent()
        self._expecting = True
        self._ready = [False] * len(self.params)
        for b in self.buckets:
            b.pending = len(b.param_indices)
        if self.static_graph:
            self._counting = self._expected is None
            self._arrivals = [0] * len(self.params)
        self._next_bucket = 0
        self._futures = [None] * len(self.buckets)
        self._timings = [BucketTiming(b.index, b.nbytes) for b in self.buckets]
        self._in_flight = []
        self._callback_queued = False
        self._preset_grads()
        self._local_sq = []
        # every rank counts the same synced steps, so all measure on the same ones
        self._measure_now = self.measure_noise_scale and self._step % self.noise_scale_every == 0
        self._t_forward_end = time.perf_counter()

    def _preset_grads(self) -> None:
        # In a bucket of small tensors, each parameter without a gradient gets its (zeroed) bucket
        # view as .grad before backward, so autograd accumulates into the bucket itself: no
        # gradient tensor to allocate, no copy and no per-parameter Python work in the hook, and
        # one division per bucket at launch. For small tensors that work is the engine's cost
        # (see benchmarks/per_parameter.py); for large ones, zeroing the bucket and adding into it
        # would cost more memory traffic than the copy-and-divide it saves, so they keep it.
        # A parameter that then gets no gradient anywhere is given None back after the reduction.
        params, preset = self.params, self._preset
        for b in self.buckets:
            if not self._small[b.index]:
                continue
            missing = [k for k, i in enumerate(b.param_indices) if params[i].grad is None]
            if not missing:
                continue
            if len(missing) == len(b.param_indices):
                b.buffer.zero_()
            else:
                for k in missing:
                    b.views[k].zero_()
            for k in missing:
                i = b.param_indices[k]
                params[i].grad = b.views[k]
                preset[i] = True

    def release_spent(self) -> None:
        # Autograd's own gradient tensors, already copied into the buckets, are freed here, at the
        # start of the next step, rather than one by one in the middle of backward: freeing large
        # blocks while backward still allocates lets the C allocator hand pages back to the OS and
        # fault them in again (measured: ~10,000 page faults and several ms per transformer step).
        # Freed here, they are reused like the gradients of a model without DDP.
        self._spent.clear()

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

    # -- autograd side ---------------------------------------------------------------------
    def _make_hook(self, i: int):
        def hook(param: torch.Tensor) -> None:
            self._on_grad_ready(i, param)

        return hook

    def _make_sparse_hook(self, i: int):
        def hook(param: torch.Tensor) -> None:
            # the sparse gradient stays in .grad (accumulated there by autograd); reduced in _finalize
            self._used_since_sync[i] = True
            if self._expecting:
                self._mark_ready(i)

        return hook

    def _on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        bucket, pos = self._slot[i]
        view = bucket.views[pos]
        grad = param.grad
        expecting = self._expecting
        more_to_come = False  # static graph: this gradient arrives again in this backward
        if expecting and (self._counting or (self._expected is not None and self._expected[i] > 1)):
            self._arrivals[i] += 1
            more_to_come = self._counting or self._arrivals[i] < self._expected[i]
        # a bucket of large tensors is divided tensor by tensor, fused with the copy; one of
        # small tensors once, at launch (see _preset_grads)
        divide = expecting and not more_to_come and self.comm_hook is None and not self._small[bucket.index]
        if grad is not view and grad.data_ptr() != view.data_ptr():
            if grad.requires_grad:  # backward(create_graph=True)
                grad = self._detached(param)
            if divide:
                torch.div(grad, self.divisor, out=view)  # copy and pre-divide in one pass
            else:
                view.copy_(grad)
            param.grad = view
            self._spent.append(grad)
        elif divide:
            # autograd added into the view in place: it holds the local sum, divided now
            view.div_(self.divisor)
        self._used_since_sync[i] = True
        if not expecting:
            return
        if self._counting:
            self._ready[i] = True
            self._queue_finalize()
            return
        if more_to_come:
            return
        if self._in_flight:
            self._stamp_completed()
        if self._ready[i]:
            self._raise_twice(i)
        self._ready[i] = True
        if self._order is not None:
            self._order.append(i)
        if not self._callback_queued:
            self._queue_finalize()
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready_buckets()

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
        if self.comm_hook is None and self.divisor != 1 and self._small[bucket.index]:
            bucket.buffer.div_(self.divisor)  # the views hold local sums: average once per bucket
        if self._measure_now:
            # this rank's gradient, right after the division (a small bucket is still in cache):
            # divided by the divisor without a hook, undivided with one (the hook contract)
            self._local_sq.append(bucket_sq_norm(bucket.buffer))
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
        self.last_backward_end_epoch_ns = time.time_ns()
        if self._order is not None:
            self.first_ready_order, self._order = self._order, None
        if self._counting:
            self._end_counting()
        allow_unused = self.find_unused_parameters or self.static_graph
        missing = [i for i in self.dense_indices if not self._ready[i]]
        missing_sparse = [i for i in self.sparse_indices if not self._ready[i]]
        if (missing or missing_sparse) and not allow_unused:
            self._abort_launched()
            missing += missing_sparse
            names = ", ".join(repr(self.names[i]) for i in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise RuntimeError(
                f"parameters got no gradient in this backward pass: {names}{more}. If they are "
                "unused in forward on purpose, construct DistributedDataParallel with "
                "find_unused_parameters=True; otherwise make sure every parameter takes part in "
                "computing the loss."
            )
        had_grad = {}
        for i in missing:
            bucket, pos = self._slot[i]
            p, view = self.params[i], bucket.views[pos]
            # a gradient of the user's (accumulated in no_sync steps), not the zeros we preset
            had_grad[i] = p.grad is not None and not (self._preset[i] and p.grad is view)
            if p.grad is None:
                view.zero_()  # contributes nothing from this rank
            elif p.grad is not view and p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            if p.grad is not None and self.comm_hook is None and not self._small[bucket.index]:
                view.div_(self.divisor)  # a local accumulated sum, undivided so far
            bucket.pending -= 1
        self._launch_ready_buckets()
        sparse_futures = [self._reduce_sparse(i, k) for k, i in enumerate(self.sparse_indices)]
        # every rank must issue this collective, also one that saw every gradient
        unused = missing + missing_sparse
        had_grad.update({i: self.params[i].grad is not None for i in missing_sparse})
        used = self._globally_used(unused) if allow_unused else {}
        self._used_since_sync = [False] * len(self.params)
        self._wait_all()
        for i, fut in zip(self.sparse_indices, sparse_futures, strict=True):
            result = fut.wait()
            result = result[0] if isinstance(result, list) else result
            if self._ready[i] or had_grad[i] or used[i]:
                self.params[i].grad = result
        for i in missing:
            bucket, pos = self._slot[i]
            if had_grad[i] or used[i]:
                self.params[i].grad = bucket.views[pos]
            elif self._preset[i]:
                self.params[i].grad = None  # unused everywhere: as if we had never set it
        self._preset = [False] * len(self.params)
        grad_sq = self._grad_sq_norms()
        self._record_stats(t_backward_end, grad_sq)

    def _grad_sq_norms(self) -> tuple[float, float] | None:
        """(this rank's local |g|^2, the averaged |G|^2) over the dense buckets, or None."""
        if not self._measure_now or len(self._local_sq) != len(self.buckets) or not self.buckets:
            return None
        # without a hook the buffers were divided by the divisor before the reduction
        scale = 1.0 if self.comm_hook is not None else float(self.divisor) ** 2
        local = float(torch.stack(self._local_sq).sum()) * scale
        reduced = float(torch.stack([bucket_sq_norm(b.buffer) for b in self.buckets]).sum())
        self._local_sq = []
        if self.world_size > 1 and self.divisor == self.world_size:  # not while ranks have joined
            self.noise_scale.update(small_sq=local, big_sq=reduced, b_small=1, b_big=self.world_size)
        return local, reduced

    def _end_counting(self) -> None:
        # the counting backward launched nothing yet and divided nothing
        self._counting = False
        self._expected = list(self._arrivals)
        for i in self.dense_indices:
            if self._ready[i]:
                bucket, pos = self._slot[i]
                if self.comm_hook is None and not self._small[bucket.index]:
                    bucket.views[pos].div_(self.divisor)  # large tensors: divided per tensor
                bucket.pending -= 1

    def _reduce_sparse(self, i: int, k: int) -> torch.futures.Future:
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
            return hook(state, GradBucket(index, grad, [p], [grad], [0], is_last=is_last))
        grad = grad / self.divisor
        return dist.all_reduce(grad, group=self.process_group, async_op=True).get_future()

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

    def _record_stats(self, t_backward_end: float, grad_sq: tuple[float, float] | None = None) -> None:
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
        if grad_sq is not None:
            s = self.last_stats
            s.grad_sq_norm_local, s.grad_sq_norm_global = grad_sq
            s.gradient_noise_scale = self.noise_scale.b_simple
