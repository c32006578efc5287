"""`dpscale.DistributedDataParallel`: the module wrapper users swap in for torch's.

It checks that every rank holds the same model, makes the replicas identical (rank 0's
parameters and buffers win), lays gradients out in buckets, and arms the reducer on each forward
that will be followed by a synchronized backward.

It is a subclass of `torch.nn.parallel.DistributedDataParallel` whose constructor never runs
torch's: code that asks `isinstance(model, DistributedDataParallel)` (Lightning, Accelerate, the
HF Trainer, torch's own helpers) sees a DDP model, and every method of torch's that would reach
torch's C++ reducer is overridden here. Arguments are torch 2.13's, in torch's order.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable

from dpscale.comm import Transport, make_transport
from dpscale.comm.base import group_rank
from dpscale.engine.autotune import BucketAutotuner
from dpscale.engine.buckets import MB, assign_buckets_of, build_buckets
from dpscale.engine.collective_log import CollectiveLog
from dpscale.engine.compat import ddp_logging, join, torch_private
from dpscale.engine.compat.model_check import broadcast_coalesced, check_same_model, sparse_gradient_params
from dpscale.engine.compat.torch_args import (
    DEFAULT_FIRST_BUCKET_CAP_MB,
    check_comm_hook,
    check_torch_args,
    input_device,
    move_to,
)
from dpscale.engine.hooks import CommHook, allreduce_hook, fp16_compress_hook
from dpscale.engine.noise_scale import NoiseScaleObserver
from dpscale.engine.observers import StepObserver
from dpscale.engine.profiler_ranges import FORWARD, profiler_enabled, record_function
from dpscale.engine.reducer import Reducer
from dpscale.engine.stats import StepStats
from dpscale.log import get_logger

logger = get_logger(__name__)

# torch's class, taken at import: a sitecustomize that swaps ours in replaces the name afterwards
_TorchDDP = torch.nn.parallel.distributed.DistributedDataParallel


class DistributedDataParallel(_TorchDDP):
    """Data parallelism for `module` over `process_group` (default: the global group).

    Arguments are `torch.nn.parallel.DistributedDataParallel`'s (see torch_args.py for how each
    is honoured or refused); the differences are listed in README's compatibility table.

    dpscale's own, keyword-only: `first_bucket_cap_mb` the size of the first bucket; None (the
    default) follows torch 2.13: 1 MiB when `bucket_cap_mb` is left at its default (or "auto"),
    `bucket_cap_mb` when it is given. `bucket_cap_mb="auto"` tries sizes over the first steps and
    keeps the fastest.
    `transport` ("auto", "gloo", "nccl", "shm", "hierarchical", or a `dpscale.comm.Transport`)
    carries the default gradient reduction; "auto" uses shared memory for CPU workers on one
    host (see dpscale.comm.select). Rank 0 prints the choice once. `collective_timeout_s` (300):
    how long the transport waits for a peer before raising. `collective_log`: where to record the
    collectives issued (see `collective_log.py`); default a new one, available as `.collective_log`.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | str | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params=None,
        param_to_hook_all_reduce=None,
        mixed_precision=None,
        device_mesh=None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[int] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        first_bucket_cap_mb: float | None = None,
        transport: str | Transport = "auto",
        collective_timeout_s: float = 300.0,
        collective_log: CollectiveLog | None = None,
    ):
        if isinstance(module, _TorchDDP):
            raise ValueError(
                f"module is already wrapped in {type(module).__module__}.DistributedDataParallel; "
                "pass the unwrapped model (its .module)"
            )
        nn.Module.__init__(self)
        Joinable.__init__(self)
        args = check_torch_args(
            module,
            device_ids=device_ids,
            output_device=output_device,
            dim=dim,
            broadcast_buffers=broadcast_buffers,
            init_sync=init_sync,
            process_group=process_group,
            bucket_cap_mb=bucket_cap_mb,
            check_reduction=check_reduction,
            delay_all_reduce_named_params=delay_all_reduce_named_params,
            param_to_hook_all_reduce=param_to_hook_all_reduce,
            mixed_precision=mixed_precision,
            device_mesh=device_mesh,
            bucket_cap_mb_list=bucket_cap_mb_list,
            forward_sync_buffers=forward_sync_buffers,
        )
        if first_bucket_cap_mb is None:
            # torch 2.13's rule (BucketCapacityConfig): a small first bucket only with the default
            # cap; a cap given explicitly is the first bucket's too. A small first bucket is one
            # more collective per step: on the mlp its 45 KB ahead of 24 MB hide nothing, and its
            # all-reduce cost ~0.6 ms of the backward thread per step (benchmarks/engine_ab.py)
            # (check_torch_args refused any string but "auto")
            if bucket_cap_mb is None or bucket_cap_mb == "auto":
                first_bucket_cap_mb = DEFAULT_FIRST_BUCKET_CAP_MB
            else:  # any number, numpy's included
                first_bucket_cap_mb = float(bucket_cap_mb)
        bucket_cap_mb = args.bucket_cap_mb
        self._autotuner = None
        if bucket_cap_mb == "auto":
            self._autotuner = BucketAutotuner(args.process_group)
            bucket_cap_mb = self._autotuner.first_cap_mb
        elif isinstance(bucket_cap_mb, str):
            raise ValueError(f"bucket_cap_mb must be a number of MiB or 'auto', got {bucket_cap_mb!r}")
        if bucket_cap_mb <= 0 or first_bucket_cap_mb <= 0:
            raise ValueError(
                f"bucket_cap_mb ({bucket_cap_mb}) and first_bucket_cap_mb ({first_bucket_cap_mb}) must be > 0"
            )
        self.module = module
        self.process_group = args.process_group
        self.parameters_to_ignore = set(args.ignored)
        self.bucket_cap_mb = bucket_cap_mb
        self.bucket_bytes_cap = int(bucket_cap_mb * MB)
        self.first_bucket_cap_mb = first_bucket_cap_mb
        self.forward_sync_buffers = args.sync_buffers_in_forward  # broadcast_buffers (below) reads it
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = False
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy
        self.mixed_precision = None
        self.dim = dim
        self._input_device = input_device(module, device_ids, self.parameters_to_ignore)
        self.device_ids = None if self._input_device is None else [self._input_device.index]
        self.output_device = None if self._input_device is None else self._input_device.index
        self.device = next(p.device for n, p in module.named_parameters() if n not in args.ignored)
        self.device_type = self.device.type
        self.is_multi_device_module = False
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.logger = None  # torch's C++ logger; ours is ddp_logging.py
        self._divide_by_initial_world_size = True
        self._transport_spec = transport if isinstance(transport, str) else None
        self._collective_timeout_s = collective_timeout_s
        self.collective_log = collective_log or CollectiveLog(self.process_group)
        self._build_engine(transport, sync=args.init_sync, sync_buffers=args.sync_buffers_at_init)
        if static_graph:
            self._set_static_graph()

    def _build_engine(self, transport: str | Transport, *, sync: bool, sync_buffers: bool) -> None:
        """Buckets, transport and reducer: what __init__ and unpickling both build (collective)."""
        module, group, log = self.module, self.process_group, self.collective_log
        named = [
            (n, p)
            for n, p in module.named_parameters()
            if p.requires_grad and n not in self.parameters_to_ignore
        ]
        self._module_parameters = [p for _, p in named]
        sparse = sparse_gradient_params(module, [p for _, p in named], group)
        dense = [k for k in range(len(named)) if k not in sparse]
        params = [p for _, p in named]
        assignment = assign_buckets_of(params, dense, self.bucket_cap_mb, self.first_bucket_cap_mb)
        self.bucket_assignment = [[named[i][0] for i in b] for b in assignment]
        self.modules_buffers = [b for n, b in module.named_buffers() if n not in self.parameters_to_ignore]
        if sync:
            # before any per-bucket collective: a layout that differs between ranks would make them hang
            check_same_model(module, group, self.bucket_assignment, log)
            # replicas start identical: rank 0's parameters and buffers win
            state = [p.detach() for n, p in module.named_parameters() if n not in self.parameters_to_ignore]
            state += self.modules_buffers if sync_buffers else []
            if state:
                broadcast_coalesced(state, group, log=log, what="initial parameters and buffers")
        if isinstance(transport, str):
            built: Transport = make_transport(
                transport, group, self.device, timeout_s=self._collective_timeout_s
            )
            if group_rank(group) == 0 and sync:
                logger.info("transport %s", built.describe())
        else:
            built = transport
        self.transport: Transport = built
        buckets = build_buckets(params, assignment, alloc=built.alloc)
        self.reducer = Reducer(
            params,
            [n for n, _ in named],
            buckets,
            group,
            built,
            self.find_unused_parameters,
            log,
            sparse=sorted(sparse),
            gradient_as_bucket_view=self.gradient_as_bucket_view,
        )
        self.reducer.static_graph = self.static_graph
        self._stats = ddp_logging.RuntimeStats()
        self.add_step_observer(self._stats)  # asks for no norms: the sampled steps' StepStats
        # measured by default, as before the observer seam: every 8th synced step's norms
        self._noise_scale: NoiseScaleObserver | None = None
        self.set_noise_scale_observer(NoiseScaleObserver())

    # -- the torch DDP surface -------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        sync_grads = torch.is_grad_enabled() and self.require_backward_grad_sync
        joining = torch_private.join_enabled(self)
        if joining:
            join.notify(self, sync_grads)
        else:
            self.reducer.divisor = self.reducer.world_size
        if self.will_sync_module_buffers():
            src = join.authoritative_rank(self, candidate=True) if joining else 0
            broadcast_coalesced(
                self.modules_buffers, self.process_group, src, log=self.collective_log, what="buffers"
            )
        if joining:
            join.announce_backward_sync(self, sync_grads)
        if self._input_device is not None:
            inputs, kwargs = move_to(inputs, self._input_device), move_to(kwargs, self._input_device)
        if sync_grads and self._autotuner is not None and not self._autotuner.done:
            self._autotune_step()
        # the engine's clock (events on a GPU: host time would measure the launch), and the host's
        # wall clock for where the forward began (torch's forward_compute_time_start)
        clock, t0_epoch_ns = self.reducer.clock, time.time_ns()
        t0 = clock.stamp() if self._stats.samples_next() else None
        # a torch.profiler the script runs gets dpscale's ranges (profiler_ranges.py); else none
        profiled = profiler_enabled()
        with record_function(FORWARD) if profiled else nullcontext():
            out = self.module(*inputs, **kwargs)
        # read again after the module ran, as torch does: Lightning's manual optimization turns
        # sync off from inside forward and arms the reducer itself before backward
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self.require_forward_param_sync = True
            t1 = None if t0 is None else clock.stamp()
            self._stats.on_forward(clock, t0, t1, t0_epoch_ns, self.reducer)
            self.reducer.profiling = profiled
            self.reducer.prepare_for_backward()
        else:
            self.require_forward_param_sync = False
            self.reducer.disarm()
        return out

    # torch 2.14 made broadcast_buffers a property over forward_sync_buffers; 2.11 sets a plain
    # attribute in the constructor dpscale does not run, so the engine answers it itself
    @property
    def broadcast_buffers(self) -> bool:
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def will_sync_module_buffers(self) -> bool:
        return self.require_forward_param_sync and self.forward_sync_buffers and len(self.modules_buffers) > 0

    def _autotune_step(self) -> None:
        tuner = self._autotuner
        assert tuner is not None  # bucket_cap_mb="auto"
        tuner.clock = self.reducer.clock
        cap = tuner.on_synced_forward(tuner.clock.stamp())
        if cap is not None and cap != self.bucket_cap_mb:
            self._rebuild_buckets(cap)
        if tuner.done and tuner.decision is not None and group_rank(self.process_group) == 0:
            logger.info("%s", tuner.decision.describe())

    def _rebuild_buckets(self, cap_mb: float) -> None:
        """Collective (the transport allocates): every rank rebuilds at the same synced step."""
        params, dense = self.reducer.params, self.reducer.dense_indices
        assignment = assign_buckets_of(params, dense, cap_mb, self.first_bucket_cap_mb)
        old = self.reducer.buckets
        self.reducer.set_buckets(build_buckets(params, assignment, alloc=self.transport.alloc))
        for b in old:
            self.transport.release(b.buffer)
        self.bucket_cap_mb = cap_mb
        self.bucket_bytes_cap = int(cap_mb * MB)
        names = self.reducer.names
        self.bucket_assignment = [[names[i] for i in b] for b in assignment]

    @property
    def autotune_decision(self):
        """With bucket_cap_mb="auto": what was tried and kept (None until decided)."""
        return None if self._autotuner is None else self._autotuner.decision

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next synced one reduces the sum."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Replace the reduction of each bucket by `hook(state, bucket) -> Future[Tensor]`.

        Same contract and checks as torch DDP: the bucket's buffer holds this rank's undivided
        gradients and the future's value must be the average over ranks. Register at most once.
        """
        try:
            check_comm_hook(hook)
            if self.reducer.comm_hook is not None:
                raise RuntimeError(
                    "register_comm_hook or register_builtin_comm_hook can only be called once."
                )
        except (TypeError, ValueError, RuntimeError) as e:
            self._stats.error = str(e)  # torch logs it too: _get_ddp_logging_data()["error"]
            raise
        self.reducer.comm_hook = (state, hook)
        self._comm_hook_name = getattr(hook, "__qualname__", repr(hook))

    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        hooks = {
            dist.BuiltinCommHookType.ALLREDUCE: allreduce_hook,
            dist.BuiltinCommHookType.FP16_COMPRESS: fp16_compress_hook,
        }
        self.register_comm_hook(self.process_group, hooks[comm_hook_type])

    def _register_fused_optim(self, optim, *args, optim_params=None, **kwargs):
        raise ValueError(
            "_register_fused_optim: running the optimizer inside the reduction is not supported "
            "by dpscale's engine; step the optimizer after backward"
        )

    def _update_process_group(self, new_process_group):
        raise ValueError("_update_process_group: build a new DistributedDataParallel for the new group")

    def join_hook(self, **kwargs):
        """Shadows this engine's collectives on a rank that ran out of inputs (see join.py)."""
        return join.DDPJoinHook(
            self, divide_by_initial_world_size=kwargs.get("divide_by_initial_world_size", True)
        )

    # -- private methods other libraries call ------------------------------------------------
    def _get_ddp_logging_data(self) -> dict:
        return ddp_logging.logging_data(self)

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        if sample_rate < 1:
            raise ValueError("DDP runtime logging sample rate should be equal or greater than 1")
        self._stats.sample_rate = sample_rate

    def _set_static_graph(self) -> None:
        """The graph is the same every step: parameters may go unused (found once, then known)
        and may receive their gradient more than once per backward (reentrant checkpointing)."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        if self._stats.forwards > 0:
            # the first synced backward is where a static graph is learnt (as in torch)
            self._stats.error = "_set_static_graph() should be called before training loop starts"
            raise RuntimeError(self._stats.error)
        self.static_graph = True
        self.reducer.static_graph = True

    def _remove_autograd_hooks(self) -> None:
        self.reducer.remove_hooks()

    def _check_reducer_finalized(self) -> None:
        self.reducer.check_finalized()

    # -- pickling: what torch.save(model) keeps, and what is rebuilt on load ------------------
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for k in (
            "process_group",
            "reducer",
            "transport",
            "collective_log",
            "_autotuner",
            "_stats",
            "_noise_scale",
        ):
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict) -> None:
        # like torch's: an unpickled model uses the default group, with a fresh transport and
        # reducer (collective: every rank loads at the same point); a comm hook is not kept
        nn.Module.__setstate__(self, state)
        world = dist.group.WORLD  # the default group, as torch's unpickling uses
        if world is None:  # torch's words (its _get_default_group)
            raise ValueError(
                "Default process group has not been initialized, please make sure to call init_process_group."
            )
        self.process_group = world
        self.collective_log = CollectiveLog(self.process_group)
        self._autotuner = None
        self.__dict__.pop("_comm_hook_name", None)
        self._build_engine(self._transport_spec or "auto", sync=False, sync_buffers=False)
        if self.static_graph:
            self.reducer.static_graph = True

    def close(self) -> None:
        """Detach from the module (its parameters' hooks) and give back the transport's buffers.

        The module keeps working on its own afterwards; this wrapper must not be used again.
        """
        self.reducer.remove_hooks()
        self.transport.close()

    @property
    def last_step_stats(self) -> StepStats | None:
        """Communication timings of the last synchronized backward (see `StepStats`)."""
        return self.reducer.last_stats

    # -- measurement: the observer seam (observers.py) ----------------------------------------
    def add_step_observer(self, observer: StepObserver) -> None:
        """Call `observer.on_step(stats, norms)` after every synchronized backward, with the
        step's `StepStats` and, on the steps it asks for, the gradient norms (see observers.py).
        Observers are not kept when the model is pickled."""
        self.reducer.observers.append(observer)

    def remove_step_observer(self, observer: StepObserver) -> None:
        """Stop calling `observer` (ValueError if it was never added)."""
        self.reducer.observers.remove(observer)

    @property
    def noise_scale(self) -> NoiseScaleObserver | None:
        """The observer estimating the gradient noise scale (None: not measured). Default: a
        `NoiseScaleObserver()`, measuring every 8th synced step."""
        return self._noise_scale

    def set_noise_scale_observer(self, observer: NoiseScaleObserver | None) -> None:
        """Measure the gradient noise scale with `observer` instead of the current one (None:
        not at all, no norms taken)."""
        if self._noise_scale is not None:
            self.remove_step_observer(self._noise_scale)
        self._noise_scale = observer
        if observer is not None:
            self.add_step_observer(observer)

    def set_synced_steps(self, steps: int) -> None:
        """Count synced steps from `steps` (a resumed run's position): observers are asked about
        the same steps (e.g. the noise scale measured on them) as in a run never interrupted."""
        self.reducer.set_synced_steps(steps)

    @property
    def has_sparse_gradients(self) -> bool:
        """Whether some parameter's gradient is sparse (reduced outside the buckets, so outside
        `GradNorms`)."""
        return bool(self.reducer.sparse_indices)
