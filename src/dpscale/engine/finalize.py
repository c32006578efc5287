"""After backward: unused and sparse parameters, waiting for every reduction, the step's statistics.

`Reducer`'s completion side (its state is set up in reducer.py). `_finalize` runs once per synced
backward, queued on the autograd engine by the first gradient (readiness.py): it finds parameters
that got no gradient (an error unless find_unused_parameters or a static graph), launches what is
left, reduces sparse gradients each on its own, agrees with the other ranks which parameters were
used anywhere, waits for every bucket and records when each reduction ended (stats.py). With a
static graph the first synced backward only counts gradient arrivals (`_end_counting`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dpscale.engine.hooks import GradBucket, checked_future
from dpscale.engine.noise_scale import bucket_sq_norm
from dpscale.engine.stats import StepStats


class Finalize:
    """What runs once backward is over; mixed into `Reducer`."""

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
        # a bucket launches once its last gradient is in: with every bucket launched, none is missing
        launched_all = self._next_bucket == len(self.buckets)
        missing = [] if launched_all else [i for i in self.dense_indices if not self._ready[i]]
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
            bucket, _, view, small = self._slot[i]
            p = self.params[i]
            # a gradient of the user's (accumulated in no_sync steps), not the zeros we preset
            had_grad[i] = p.grad is not None and not self._preset[i]
            # a local accumulated sum, undivided so far (a bucket of small tensors: at launch)
            divide = self.comm_hook is None and not small
            if p.grad is None:
                view.zero_()  # contributes nothing from this rank
            elif p.grad is not view and p.grad.data_ptr() != view.data_ptr():
                self._copy_in(p.grad, view, divide)
            elif divide:
                self._divide_view(i, view)
            bucket.pending -= 1
        self._launch_ready_buckets()
        sparse_futures = [self._reduce_sparse(i, k) for k, i in enumerate(self.sparse_indices)]
        # every rank must issue this collective, also one that saw every gradient
        unused = missing + missing_sparse
        had_grad.update({i: self.params[i].grad is not None for i in missing_sparse})
        used = self._globally_used(unused) if allow_unused else {}
        self._used_since_sync = [False] * len(self.params)
        self._wait_all()
        results = [fut.wait() for fut in sparse_futures]
        # every reduction is over: what follows (gradients into .grad, norms) is not communication
        t_done = time.perf_counter()
        for i, result in zip(self.sparse_indices, results, strict=True):
            result = result[0] if isinstance(result, list) else result
            if self._ready[i] or had_grad[i] or used[i]:
                self.params[i].grad = result
        for i in missing:
            view = self._slot[i][2]
            p = self.params[i]
            if had_grad[i] or used[i]:
                if p.grad is None or self.gradient_as_bucket_view:
                    p.grad = view
                # else: a tensor of its own, which _copy_out fills
            elif self._preset[i]:
                p.grad = None  # unused everywhere: as if we had never set it
        self._preset = [False] * len(self.params)
        self._viewed_unsynced.clear()
        if not self.gradient_as_bucket_view:
            self._copy_out()
        grad_sq = self._grad_sq_norms()
        self._record_stats(t_backward_end, t_done, grad_sq)

    def _copy_out(self) -> None:
        """gradient_as_bucket_view=False: the reduced values into each .grad, a tensor apart
        from the bucket as in torch (the bucket is overwritten by the next step's reduction):
        one copy per bucket of small tensors (its pool, see reducer.GradPool), one fused copy
        for the other gradients."""
        own, reduced = [], []
        for b in self.buckets:
            members = self._members[b.index]
            pool = self._pools[b.index]
            if pool is not None and pool.gaps([p.grad for p in members]) is not None:
                pool.flat.copy_(b.buffer)
                continue
            for p, view in zip(members, b.views, strict=True):
                grad = p.grad
                if grad is None:
                    continue
                if grad is view:  # used only on other ranks: no gradient of its own yet
                    p.grad = view.clone()
                else:
                    own.append(grad)
                    reduced.append(view)
        if own:
            torch._foreach_copy_(own, reduced)

    def _grad_sq_norms(self) -> tuple[float, float | None] | None:
        """(this rank's local |g|^2, the averaged |G|^2 or None when the caller takes it, see
        `noise_scale_reduced_norm`) over the dense buckets, or None."""
        if not self._measure_now or len(self._local_sq) != len(self.buckets) or not self.buckets:
            return None
        # without a hook the buffers were divided by the divisor before the reduction
        scale = 1.0 if self.comm_hook is not None else float(self.divisor) ** 2
        local = float(torch.stack(self._local_sq).sum()) * scale
        self._local_sq = []
        reduced = None
        if self.noise_scale_reduced_norm:
            reduced = float(torch.stack([bucket_sq_norm(b.buffer) for b in self.buckets]).sum())
        # the rank's own estimate needs the averaged norm, and not while ranks have joined (the
        # average is then over fewer ranks); one rank never measures (see prepare_for_backward)
        if reduced is not None and self.divisor == self.world_size:
            self.noise_scale.update(small_sq=local, big_sq=reduced, b_small=1, b_big=self.world_size)
        return local, reduced

    def _end_counting(self) -> None:
        # the counting backward launched nothing yet and divided nothing
        self._counting = False
        self._expected = list(self._arrivals)
        for i in self.dense_indices:
            if self._ready[i]:
                bucket, _, view, small = self._slot[i]
                if self.comm_hook is None and not small:
                    # large tensors: divided per tensor, as the hook's copy would have
                    view.mul_(1.0 / self.divisor)
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
            return checked_future(hook(state, GradBucket(index, grad, [p], [grad], [0], is_last=is_last)))
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

    def _record_stats(
        self, t_backward_end: float, t_done: float, grad_sq: tuple[float, float] | None = None
    ) -> None:
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
