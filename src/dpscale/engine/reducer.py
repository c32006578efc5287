"""Readiness tracking: launch each bucket's reduction as soon as its last gradient is ready.

The `Reducer` is split by phase: this file holds its state and what the wrapper calls (arming
before a synced backward, presetting small-tensor gradients, changing the bucket layout);
readiness.py what autograd calls during backward (a gradient into its bucket view, a full bucket
launched in bucket order); finalize.py what runs once backward is over (unused and sparse
parameters, waiting for every reduction, the step's statistics).

Sparse gradients (Embedding/EmbeddingBag with sparse=True) have no place in a flat buffer: each is
reduced on its own after backward (gloo all-reduces sparse tensors), or handed to the comm hook as
a bucket of its own, as torch does. With a static graph, the first synced backward only counts how
often each parameter receives a gradient (reentrant checkpointing gives some two); later ones
launch a bucket when every expected gradient has arrived.
"""

from __future__ import annotations

import operator
import sys
import time

import torch
import torch.distributed as dist

from dpscale.engine.buckets import Bucket
from dpscale.engine.collective_log import CollectiveLog
from dpscale.engine.finalize import Finalize
from dpscale.engine.hooks import CommHook
from dpscale.engine.noise_scale import NoiseScaleEstimator
from dpscale.engine.readiness import Readiness
from dpscale.engine.stats import BucketTiming, StepStats

# A bucket whose tensors average at most this many elements gets gradients accumulated in place
# (see Reducer._preset_grads): around here per-tensor Python work costs about what copying the
# tensor does (~5 us against 32 KiB at a few GB/s)
SMALL_TENSOR_NUMEL = 8192


class Reducer(Readiness, Finalize):
    """Reduces a model's gradients bucket by bucket during each synced backward."""

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
        # gradient_as_bucket_view: .grad became its bucket view in a no_sync backward. torch's
        # reducer leaves .grad alone outside synced steps, so there it is still a tensor of its own
        # and is multiplied by 1/divisor at the sync, not divided in place (see _preset_grads)
        self._viewed_unsynced: set[int] = set()
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
        # measure on every this many synced steps (benchmarks/noise_scale_cost.py has the cost)
        self.noise_scale_every = 8
        # take the averaged gradient's norm after the reduction (a second read of every gradient).
        # A loop that takes the norm of the reduced gradients anyway (dpscale's Trainer, for its
        # skip check and clipping) turns this off and pairs that norm with grad_sq_norm_local:
        # the step then costs one read of each gradient, while it is still in cache
        self.noise_scale_reduced_norm = True
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
        self._small = [b.buffer.numel() <= SMALL_TENSOR_NUMEL * len(b.param_indices) for b in buckets]
        # where each parameter's gradient lives, indexed by parameter (None: sparse): (bucket,
        # position in the bucket, its view, whether the bucket is one of small tensors), looked
        # up once per gradient by the hook
        self._slot: list[tuple[Bucket, int, torch.Tensor, bool] | None] = [None] * len(self.params)
        for b in buckets:
            for pos, i in enumerate(b.param_indices):
                self._slot[i] = (b, pos, b.views[pos], self._small[b.index])
        self._members = [[self.params[i] for i in b.param_indices] for b in buckets]
        self._pools: list[GradPool | None] = [None] * len(buckets)
        if old is not buckets and self.gradient_as_bucket_view:
            for i, p in enumerate(self.params):
                if p.grad is not None:
                    _, _, view, _ = self._slot[i]
                    view.copy_(p.grad)
                    p.grad = view
        self._futures = [None] * len(buckets)
        # per bucket of small tensors: which of its gradients are divided in place at launch
        # (True: all, False: none, else their positions), see _preset_grads
        self._in_place: list[bool | set[int]] = [False] * len(buckets)
        # per bucket: position in the bucket -> that tensor's local squared norm
        self._tensor_sq: list[dict[int, torch.Tensor]] = [{} for _ in buckets]

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
        self._tensor_sq = [{} for _ in self.buckets]
        # every rank counts the same synced steps, so all measure on the same ones. One rank has
        # no small/large pair to measure (its gradient is the average): no norms, no cost
        self._measure_now = (
            self.measure_noise_scale and self.world_size > 1 and self._step % self.noise_scale_every == 0
        )
        self._t_forward_end = time.perf_counter()

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
        self._in_place = [False] * len(self.buckets)
        for b in self.buckets:
            if not self._small[b.index]:
                continue
            missing = [k for k, i in enumerate(b.param_indices) if params[i].grad is None]
            if self.gradient_as_bucket_view:
                self._in_place[b.index] = self._divided_in_place(b, missing)
            if not missing:
                continue
            if self.gradient_as_bucket_view:
                grads = b.views
                _zero_views(b.buffer, grads, missing)
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
        pool = self._pools[b.index]
        if pool is None or not pool.free():
            pool = self._pools[b.index] = GradPool(b)
        else:
            _zero_views(pool.flat, pool.views, missing)
        return pool

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


def _zero_views(flat: torch.Tensor, views: list[torch.Tensor], positions: list[int]) -> None:
    """Zero `views[k]` for k in `positions`, all of `flat` in one call when that is every view."""
    if len(positions) == len(views):
        flat.zero_()
    else:
        for k in positions:
            views[k].zero_()


class GradPool:
    """gradient_as_bucket_view=False, a bucket of small tensors: the `.grad` tensors, views into
    one flat buffer laid out as the bucket. Autograd accumulates into them; the bucket gets one
    copy of the buffer at launch and gives one back after the reduction. Reused from step to
    step while nobody else holds a reference to one of them, so a step allocates nothing."""

    def __init__(self, bucket: Bucket):
        self.flat = torch.zeros_like(bucket.buffer)
        spans = zip(bucket.offsets, bucket.views, strict=True)
        self.views = [self.flat[o : o + v.numel()].view_as(v) for o, v in spans]
        self._storage_refs = self._storage_use_count()

    def _storage_use_count(self) -> int:
        return torch._C._storage_Use_Count(self.flat.untyped_storage()._cdata)

    def free(self) -> bool:
        """Whether nobody else refers to a view (a view someone took of one counts too: it
        shares the storage). `.grad` pointing at a view adds no Python reference (autograd holds
        the tensor in C++); a user's `g = p.grad` does."""
        for view in self.views:
            # self.views, this loop's `view` and getrefcount's argument
            if sys.getrefcount(view) > 3:
                return False
        return self._storage_use_count() == self._storage_refs

    def gaps(self, grads: list[torch.Tensor | None]) -> list[int] | None:
        """Where `grads` (the bucket's `.grad`s, in bucket order) are None, if every other one is
        this pool's view at its place; None if some gradient is a tensor of its own."""
        if all(map(operator.is_, grads, self.views)):  # every step but odd ones: no loop in Python
            return []
        if all(g is None or g is v for g, v in zip(grads, self.views, strict=True)):
            return [k for k, g in enumerate(grads) if g is None]
        return None
