"""`dpscale.DistributedDataParallel`: the module wrapper users swap in for torch's.

It checks that every rank holds the same model, makes the replicas identical (rank 0's
parameters and buffers win), lays gradients out in buckets, and arms the reducer on each forward
that will be followed by a synchronized backward. The process group is torch.distributed's.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import Transport, make_transport
from ..comm.base import global_rank
from .autotune import BucketAutotuner
from .buckets import MB, assign_buckets, build_buckets
from .collective_log import CollectiveLog
from .hooks import CommHook
from .reducer import Reducer
from .stats import StepStats


class DistributedDataParallel(nn.Module):
    """Data parallelism for `module` over `process_group` (default: the global group).

    Keyword arguments follow `torch.nn.parallel.DistributedDataParallel`:

    - `device_ids`: for a CUDA module, `[device]`; inputs are moved there. None for CPU.
    - `output_device`: accepted for compatibility; outputs stay where the module puts them.
    - `bucket_cap_mb` (25) / `first_bucket_cap_mb` (1): bucket sizes in MiB.
    - `broadcast_buffers` (True): copy rank 0's buffers (e.g. BatchNorm statistics) to every
      rank at the start of each forward in training mode.
    - `find_unused_parameters` (False): allow parameters that get no gradient in a step.
    - `gradient_as_bucket_view`: accepted; gradients are always views into the buckets here.
    - `static_graph`: accepted; a no-op, the engine needs no graph analysis.

    dpscale's own: `transport` ("auto", "gloo", "nccl", "shm", "hierarchical", or a
    `dpscale.comm.Transport`) carries the default gradient reduction; "auto" uses shared memory
    for CPU workers on one host (see dpscale.comm.select). Rank 0 prints the choice once.
    `collective_timeout_s` (300): how long the transport waits for a peer before raising (the
    process group's own collectives use the timeout given to init_process_group).
    `collective_log`: where to record the collectives issued (see `collective_log.py`); default a
    new one, available as `.collective_log`.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | str = 25.0,
        first_bucket_cap_mb: float = 1.0,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        transport: str | Transport = "auto",
        collective_timeout_s: float = 300.0,
        collective_log: CollectiveLog | None = None,
    ):
        super().__init__()
        self._autotuner = None
        if bucket_cap_mb == "auto":
            self._autotuner = BucketAutotuner(process_group)
            bucket_cap_mb = self._autotuner.first_cap_mb
        elif isinstance(bucket_cap_mb, str):
            raise ValueError(f"bucket_cap_mb must be a number of MiB or 'auto', got {bucket_cap_mb!r}")
        if bucket_cap_mb <= 0 or first_bucket_cap_mb <= 0:
            raise ValueError(
                f"bucket_cap_mb ({bucket_cap_mb}) and first_bucket_cap_mb ({first_bucket_cap_mb}) must be > 0"
            )
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialized: call dist.init_process_group first")
        self.bucket_cap_mb = bucket_cap_mb
        self.first_bucket_cap_mb = first_bucket_cap_mb
        self.module = module
        self.process_group = process_group
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.output_device = output_device
        self.device = self._check_devices(module, device_ids)
        if self._autotuner is not None and self.device is not None:
            self._autotuner.device = self.device
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.collective_log = log = collective_log or CollectiveLog(process_group)

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        assignment = assign_buckets(params, int(bucket_cap_mb * MB), int(first_bucket_cap_mb * MB))
        self.bucket_assignment = [[named[i][0] for i in b] for b in assignment]
        # before any per-bucket collective: a layout that differs between ranks would make them hang
        _check_same_model(module, process_group, self.bucket_assignment, log)
        # replicas start identical: rank 0's parameters and buffers win
        state = [p.detach() for p in module.parameters()] + list(module.buffers())
        if state:
            _broadcast_coalesced(state, process_group, log=log, what="initial parameters and buffers")
        if isinstance(transport, str):
            transport = make_transport(
                transport,
                process_group,
                self.device or next((p.device for p in params), torch.device("cpu")),
                timeout_s=collective_timeout_s,
            )
            if dist.get_rank(process_group) == 0:
                print(f"dpscale: transport {transport.describe()}", file=sys.stderr, flush=True)
        self.transport = transport
        buckets = build_buckets(params, assignment, alloc=transport.alloc)
        self.reducer = Reducer(
            params, [n for n, _ in named], buckets, process_group, transport, find_unused_parameters, log
        )
        self._buffers_to_sync = [b for b in module.buffers()]

    @staticmethod
    def _check_devices(module: nn.Module, device_ids) -> torch.device | None:
        devices = {p.device for p in module.parameters()}
        if len(devices) > 1:
            raise ValueError(
                f"module parameters span several devices {sorted(map(str, devices))}; "
                "dpscale supports single-device modules"
            )
        device = next(iter(devices), torch.device("cpu"))
        if device.type == "cpu":
            if device_ids is not None:
                raise ValueError("device_ids must be None for a CPU module")
            return None
        if device_ids is None:
            return device
        if len(device_ids) != 1:
            raise ValueError(f"device_ids must name one device, got {device_ids}")
        return torch.device(
            device.type,
            torch.device(device_ids[0]).index if isinstance(device_ids[0], torch.device) else device_ids[0],
        )

    # -- the torch DDP surface -------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if (
            self.broadcast_buffers
            and self.training
            and self._buffers_to_sync
            and self.require_forward_param_sync
        ):
            _broadcast_coalesced(
                self._buffers_to_sync, self.process_group, log=self.collective_log, what="buffers"
            )
        if self.device is not None:
            inputs, kwargs = _move_to(inputs, self.device), _move_to(kwargs, self.device)
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            if self._autotuner is not None and not self._autotuner.done:
                self._autotune_step()
            self.reducer.prepare_for_backward()
        else:
            self.reducer.disarm()
        return self.module(*inputs, **kwargs)

    def _autotune_step(self) -> None:
        cap = self._autotuner.on_synced_forward(time.perf_counter())
        if cap is not None and cap != self.bucket_cap_mb:
            self._rebuild_buckets(cap)
        if self._autotuner.done and dist.get_rank(self.process_group) == 0:
            print(f"dpscale: {self._autotuner.decision.describe()}", file=sys.stderr, flush=True)

    def _rebuild_buckets(self, cap_mb: float) -> None:
        """Collective (the transport allocates): every rank rebuilds at the same synced step."""
        params = self.reducer.params
        assignment = assign_buckets(params, int(cap_mb * MB), int(self.first_bucket_cap_mb * MB))
        old = self.reducer.buckets
        self.reducer.set_buckets(build_buckets(params, assignment, alloc=self.transport.alloc))
        for b in old:
            self.transport.release(b.buffer)
        self.bucket_cap_mb = cap_mb
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

        Same contract as torch DDP: the bucket's buffer holds this rank's undivided gradients and
        the future's value must be the average over ranks. Register at most once, before training.
        """
        if not callable(hook):
            raise TypeError("hook must be callable as hook(state, bucket)")
        if self.reducer.comm_hook is not None:
            raise RuntimeError("register_comm_hook may be called only once")
        self.reducer.comm_hook = (state, hook)

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


def _check_same_model(
    module: nn.Module,
    group,
    buckets: list[list[str]] | None = None,
    log: CollectiveLog | None = None,
) -> None:
    """Every rank must hold the same parameters and bucket layout; name the first difference."""
    sig = [(n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()]
    sigs: list = [None] * dist.get_world_size(group)
    if log is not None:
        log.record("all_gather_object", "model signature")
    dist.all_gather_object(sigs, (sig, buckets), group=group)
    ref, ref_buckets = sigs[0]
    for rank, (other, other_buckets) in enumerate(sigs):
        if other == ref and other_buckets != ref_buckets:
            raise ValueError(
                f"gradient buckets differ between ranks 0 and {rank}: rank 0 has {len(ref_buckets)} "
                f"({_describe_buckets(ref_buckets)}), rank {rank} has {len(other_buckets)} "
                f"({_describe_buckets(other_buckets)}); pass the same bucket_cap_mb and "
                "first_bucket_cap_mb on every rank"
            )
        if other == ref:
            continue
        for k in range(max(len(ref), len(other))):
            a = ref[k] if k < len(ref) else None
            b = other[k] if k < len(other) else None
            if a != b:
                raise ValueError(
                    f"model differs between ranks 0 and {rank} at parameter #{k}: "
                    f"rank 0 has {_describe(a)}, rank {rank} has {_describe(b)}; "
                    "every rank must build the same model"
                )


def _describe_buckets(buckets: list[list[str]]) -> str:
    text = "; ".join(", ".join(b) for b in buckets[:3])
    return text + ("; ..." if len(buckets) > 3 else "")


def _describe(sig) -> str:
    if sig is None:
        return "no such parameter"
    name, shape, dtype = sig
    return f"{name!r} of shape {list(shape)} and {dtype.removeprefix('torch.')}"


@torch.no_grad()
def _broadcast_coalesced(
    tensors: list[torch.Tensor], group, src: int = 0, *, log: CollectiveLog | None = None, what: str = ""
) -> None:
    """Broadcast `tensors` from group rank `src`: one message per dtype and device, not one each."""
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    src_global = global_rank(group, src)
    for ts in by_kind.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        if log is not None:
            log.record("broadcast", what, flat)
        dist.broadcast(flat, src=src_global, group=group)
        off = 0
        for t in ts:
            t.copy_(flat[off : off + t.numel()].view_as(t))
            off += t.numel()


def _move_to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple):
        return tuple(_move_to(o, device) for o in obj)
    if isinstance(obj, list):
        return [_move_to(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _move_to(v, device) for k, v in obj.items()}
    return obj
