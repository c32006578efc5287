"""`_get_ddp_logging_data()`: torch DDP's debugging dictionary, filled from dpscale's own stats.

Libraries and dashboards read this private method of torch's class; the keys here are torch's
(2.13), each present only where dpscale has the value. Times are integers in nanoseconds as in
torch; the backward times come from the engine's `StepStats` (see stats.py): compute is backward
less the time reductions held it up, comm the time some reduction was in flight, overlap the part
of comm that backward hid. Like torch, runtime figures are taken on the first 10 synced steps and
then every `sample_rate` steps (100 unless `_set_ddp_runtime_logging_sample_rate` says otherwise).

Every duration comes from the engine's clock (clock.py): on a GPU, CUDA events, because host time
around a launch measures the launch. So `RuntimeStats` is a step observer (observers.py): a
sampled step's stats arrive once its events have completed, a step or more later, and a sampled
forward's two stamps are read the same way; nothing here waits for the device. The `*_start` /
`*_end` keys are wall-clock positions (ns since the epoch) anchored at the host's moment the
backward ended, with the measured durations laid back from it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from dpscale.comm.base import group_rank, group_size, is_registered
from dpscale.engine.observers import GradNorms, StepObserver
from dpscale.engine.stats import StepStats

if TYPE_CHECKING:
    from dpscale.engine.clock import Clock

_FIRST_ITERATIONS = 10
_NS = 1e6  # per ms


@dataclass
class RuntimeStats(StepObserver):
    sample_rate: int = 100
    forwards: int = 0  # synced forwards so far
    sampled_iteration: int = 0  # 0-based index of the last sampled synced forward (torch's "iteration")
    forward_ns: list[int] = field(default_factory=list)
    steps: list = field(default_factory=list)  # StepStats of sampled steps, as they become readable
    last_forward_ns: int = 0
    last_forward_start_ns: int = 0
    error: str | None = None  # the last error the engine raised for a misuse (torch logs it too)
    _sampled: set[int] = field(default_factory=set)  # StepStats.step of the sampled steps
    _backward_end_ns: dict[int, int] = field(default_factory=dict)  # host end of their backward
    # sampled forwards not yet read: (clock, start stamp, end stamp, host start in epoch ns)
    _pending_forwards: list[tuple[Any, Any, Any, int]] = field(default_factory=list)

    def samples_next(self) -> bool:
        """Whether the next synced forward is sampled (only those are stamped: on a GPU each
        stamp is an event recorded)."""
        index = self.forwards
        return index < _FIRST_ITERATIONS or index % self.sample_rate == 0

    def on_forward(self, clock: Clock, start: Any, end: Any, start_epoch_ns: int, reducer) -> None:
        """After a synced forward stamped `start`..`end` by `clock` (None: not sampled); `reducer`:
        the engine's, whose synced-step count names the step this forward's backward will be."""
        self.note_backward_end(reducer)
        sampled = self.samples_next() and start is not None and end is not None
        index = self.forwards
        self.forwards += 1
        if sampled:
            self.sampled_iteration = index
            self._pending_forwards.append((clock, start, end, start_epoch_ns))
            self._sampled.add(reducer.synced_steps + 1)
        self.read_forwards()

    def note_backward_end(self, reducer) -> None:
        """The host's end of the reducer's last synced backward, if that step is a sampled one."""
        step = reducer.synced_steps
        if step in self._sampled and step not in self._backward_end_ns:
            self._backward_end_ns[step] = reducer.last_backward_end_epoch_ns

    def on_step(self, stats: StepStats, norms: GradNorms | None) -> None:
        # on a GPU a step arrives once its events completed: sampled ones are kept, late or not
        if stats.step in self._sampled:
            self.steps.append(stats)

    def read_forwards(self) -> None:
        """The sampled forwards whose stamps are final, oldest first (no wait for the device)."""
        while self._pending_forwards:
            clock, start, end, start_epoch_ns = self._pending_forwards[0]
            if not clock.ready([start, end]):
                return
            self._pending_forwards.pop(0)
            self.last_forward_ns = int(clock.elapsed_ms(start, end) * _NS)
            self.last_forward_start_ns = start_epoch_ns
            self.forward_ns.append(self.last_forward_ns)

    def backward_end_ns(self, stats: StepStats) -> int:
        return self._backward_end_ns.get(stats.step, 0)


def logging_data(ddp) -> dict:
    stats: RuntimeStats = ddp._stats
    reducer = ddp.reducer
    stats.note_backward_end(reducer)
    stats.read_forwards()
    group = ddp.process_group
    params = reducer.params
    data = {
        "backend_name": dist.get_backend(group) if is_registered(group) else group.name(),
        "world_size": group_size(group),
        "rank": group_rank(group),
        "module_name": type(ddp.module).__name__,
        "device_ids": "" if ddp.device_ids is None else ", ".join(map(str, ddp.device_ids)),
        "output_device": -1 if ddp.output_device is None else ddp.output_device,
        "broadcast_buffers": int(ddp.forward_sync_buffers),
        "bucket_cap_bytes": ddp.bucket_bytes_cap,
        "find_unused_parameters": int(ddp.find_unused_parameters),
        "gradient_as_bucket_view": int(ddp.gradient_as_bucket_view),
        "static_graph": int(ddp.static_graph),
        "is_multi_device_module": 0,
        "num_parameter_tensors": len(params),
        "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
        "dtypes": ", ".join(sorted({_dtype_name(p) for p in params})),
        "bucket_sizes": ", ".join(str(b.nbytes) for b in reducer.buckets),
        "has_sync_bn": int(any("SyncBatchNorm" in type(m).__name__ for m in ddp.module.modules())),
        "iteration": stats.sampled_iteration,
        "master_addr": os.environ.get("MASTER_ADDR", "N/A"),
        "master_port": os.environ.get("MASTER_PORT", "N/A"),
        "torch_distributed_debug": os.environ.get("TORCH_DISTRIBUTED_DEBUG", "N/A"),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "N/A"),
        "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME", "N/A"),
        "gloo_device_transport": os.environ.get("GLOO_DEVICE_TRANSPORT", "N/A"),
    }
    if stats.error is not None:
        data["has_error"] = 1
        data["error"] = stats.error
    if group.name() == "gloo" and is_registered(group):
        data["gloo_num_threads"] = 2  # torch.distributed's default for a gloo group; not settable here
    data.update(_layout(reducer))
    if getattr(ddp, "_comm_hook_name", None):
        data["comm_hook"] = ddp._comm_hook_name
    if stats.forward_ns:
        data["forward_compute_time"] = stats.last_forward_ns
        data["forward_compute_time_start"] = stats.last_forward_start_ns
        data["avg_forward_compute_time"] = sum(stats.forward_ns) // len(stats.forward_ns)
    if stats.steps:
        last = stats.steps[-1]
        data["num_buckets_reduced"] = len(last.buckets)
        data["backward_compute_time"] = int(last.backward_ms * _NS)
        data["backward_comm_time"] = int(last.comm_ms * _NS)
        data["backward_compute_comm_overlap_time"] = int(max(last.comm_ms - last.exposed_comm_ms, 0) * _NS)
        n = len(stats.steps)
        data["avg_backward_compute_time"] = int(sum(s.backward_ms for s in stats.steps) * _NS / n)
        data["avg_backward_comm_time"] = int(sum(s.comm_ms for s in stats.steps) * _NS / n)
        # host-side wall-clock stamps of the last sampled step, in ns since the epoch
        end = stats.backward_end_ns(last)
        data["backward_compute_time_start"] = end - data["backward_compute_time"]
        data["backward_compute_time_end"] = end
        first = min((b.start_ms for b in last.buckets), default=last.backward_ms)
        data["backward_comm_time_start"] = end + int((first - last.backward_ms) * _NS)
        data["backward_comm_time_end"] = data["backward_comm_time_start"] + data["backward_comm_time"]
        data["avg_backward_compute_comm_overlap_time"] = int(
            sum(max(s.comm_ms - s.exposed_comm_ms, 0) for s in stats.steps) * _NS / n
        )
    if reducer.find_unused_parameters:
        data["unused_parameter_size"] = sum(p.numel() * p.element_size() for p in params if p.grad is None)
    return data


def _layout(reducer) -> dict:
    """torch reorders its buckets once, by the order gradients arrived in the first step; dpscale
    lays them out in reverse registration order from the start. When the order observed in the
    first synced backward is that layout, it is what torch's rebuild would produce, and torch's
    keys for the rebuilt layout are reported; otherwise has_rebuilt_buckets is 0."""
    order = reducer.first_ready_order
    if not order:
        return {"has_rebuilt_buckets": 0}
    layout = [i for b in reducer.buckets for i in b.param_indices]
    same = order == layout
    return {
        "prev_iteration_grad_ready_order_indices": ", ".join(map(str, order)),
        "has_rebuilt_buckets": int(same),
        **(
            {
                "rebuilt_bucket_sizes": ", ".join(str(b.nbytes) for b in reducer.buckets),
                "rebuilt_per_bucket_param_indices": ", ".join(
                    " ".join(map(str, b.param_indices)) for b in reducer.buckets
                ),
            }
            if same
            else {}
        ),
    }


def _dtype_name(p) -> str:
    return {"float32": "float", "float64": "double"}.get(str(p.dtype).removeprefix("torch."), str(p.dtype))
