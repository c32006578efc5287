"""`_get_ddp_logging_data()`: torch DDP's debugging dictionary, filled from dpscale's own stats.

Libraries and dashboards read this private method of torch's class; the keys here are torch's
(2.13), each present only where dpscale has the value. Times are integers in nanoseconds as in
torch; the backward times come from the engine's `StepStats` (see stats.py): compute is backward
less the time reductions held it up, comm the time some reduction was in flight, overlap the part
of comm that backward hid. Like torch, runtime figures are taken on the first 10 synced steps and
then every `sample_rate` steps (100 unless `_set_ddp_runtime_logging_sample_rate` says otherwise).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from dpscale.comm.base import group_rank, group_size, is_registered

_FIRST_ITERATIONS = 10
_NS = 1e6  # per ms


@dataclass
class RuntimeStats:
    sample_rate: int = 100
    forwards: int = 0  # synced forwards so far
    sampled_iteration: int = 0  # 0-based index of the last sampled synced forward (torch's "iteration")
    forward_ns: list[int] = field(default_factory=list)
    steps: list = field(default_factory=list)  # StepStats of sampled steps
    last_forward_ns: int = 0
    last_forward_start_ns: int = 0
    backward_end_epoch_ns: int = 0  # when the last sampled backward ended (time.time_ns)
    error: str | None = None  # the last error the engine raised for a misuse (torch logs it too)
    _sampled_step: int | None = None  # the StepStats.step expected from the sampled forward

    def on_forward(self, t0: float, last_stats, backward_end_epoch_ns: int) -> None:
        """After a synced forward that began at perf_counter `t0`; `last_stats`: the reducer's."""
        self.collect(last_stats, backward_end_epoch_ns)
        index = self.forwards
        self.forwards += 1
        if index < _FIRST_ITERATIONS or index % self.sample_rate == 0:
            self.sampled_iteration = index
            self.last_forward_ns = int((time.perf_counter() - t0) * 1e9)
            self.last_forward_start_ns = time.time_ns() - self.last_forward_ns
            self.forward_ns.append(self.last_forward_ns)
            self._sampled_step = self.forwards

    def collect(self, last_stats, backward_end_epoch_ns: int) -> None:
        # StepStats.step counts synced backwards, as `iteration` counts synced forwards
        if last_stats is not None and last_stats.step == self._sampled_step:
            self.steps.append(last_stats)
            self.backward_end_epoch_ns = backward_end_epoch_ns
            self._sampled_step = None


def logging_data(ddp) -> dict:
    stats: RuntimeStats = ddp._stats
    stats.collect(ddp.reducer.last_stats, ddp.reducer.last_backward_end_epoch_ns)
    reducer = ddp.reducer
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
        end = stats.backward_end_epoch_ns
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
