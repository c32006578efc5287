"""torch DDP's constructor arguments that dpscale's engine takes only for compatibility.

`torch.nn.parallel.DistributedDataParallel` (2.13) has twenty arguments; a user switching engines
passes them unchanged. Each one here is either honoured (the engine reads the normalized value) or
refused with one line naming it, never accepted and silently ignored where a user could tell.
`device_ids` is honoured by `input_device` (where inputs go) and `move_to` (forward moves them).
"""

from __future__ import annotations

import copy
import inspect
import warnings
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils.rnn import PackedSequence

DEFAULT_BUCKET_CAP_MB = 25.0
# torch's dist._DEFAULT_FIRST_BUCKET_BYTES: the first bucket's cap when bucket_cap_mb is left at its default
DEFAULT_FIRST_BUCKET_CAP_MB = 1.0


@dataclass(frozen=True, kw_only=True)
class TorchArgs:
    """What the engine needs from torch's arguments, after checking them.

    - `process_group`: the group given, the 1-D `device_mesh`'s, or the default group.
    - `bucket_cap_mb`: None meant the default (25 MiB), as in torch.
    - `sync_buffers_in_forward` / `sync_buffers_at_init`: `broadcast_buffers=False` turns off
      both; `forward_sync_buffers` (torch 2.13's replacement) only the first.
    - `ignored`: names of parameters and buffers the module lists in
      `_ddp_params_and_buffers_to_ignore`: neither reduced nor broadcast.
    """

    process_group: dist.ProcessGroup
    bucket_cap_mb: float | str
    sync_buffers_in_forward: bool
    sync_buffers_at_init: bool
    init_sync: bool
    ignored: frozenset[str]


def _refuse(name: str, why: str) -> None:
    raise ValueError(f"DistributedDataParallel({name}=...): {why}")


def check_torch_args(
    module: nn.Module,
    *,
    device_ids,
    output_device,
    dim: int,
    broadcast_buffers: bool | None,
    init_sync: bool,
    process_group,
    bucket_cap_mb,
    check_reduction: bool,
    delay_all_reduce_named_params,
    param_to_hook_all_reduce,
    mixed_precision,
    device_mesh,
    bucket_cap_mb_list,
    forward_sync_buffers: bool | None,
) -> TorchArgs:
    _check_options(
        dim=dim,
        bucket_cap_mb=bucket_cap_mb,
        check_reduction=check_reduction,
        delay_all_reduce_named_params=delay_all_reduce_named_params,
        param_to_hook_all_reduce=param_to_hook_all_reduce,
        mixed_precision=mixed_precision,
        bucket_cap_mb_list=bucket_cap_mb_list,
    )
    process_group = _process_group(process_group, device_mesh)
    ignored = frozenset(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    _check_module(module, ignored, device_ids, output_device)
    if bucket_cap_mb is None:
        bucket_cap_mb = DEFAULT_BUCKET_CAP_MB
    sync_forward = True if broadcast_buffers is None else bool(broadcast_buffers)
    sync_init = sync_forward
    if forward_sync_buffers is not None:
        sync_forward, sync_init = bool(forward_sync_buffers), True
    return TorchArgs(
        process_group=process_group,
        bucket_cap_mb=bucket_cap_mb,
        sync_buffers_in_forward=sync_forward,
        sync_buffers_at_init=sync_init,
        init_sync=bool(init_sync),
        ignored=ignored,
    )


def _check_options(
    *,
    dim,
    bucket_cap_mb,
    check_reduction: bool,
    delay_all_reduce_named_params,
    param_to_hook_all_reduce,
    mixed_precision,
    bucket_cap_mb_list,
) -> None:
    """Refuse the options dpscale's engine does not support; warn about the deprecated one."""
    if delay_all_reduce_named_params is not None or param_to_hook_all_reduce is not None:
        _refuse(
            "delay_all_reduce_named_params"
            if delay_all_reduce_named_params is not None
            else "param_to_hook_all_reduce",
            "delayed all-reduce is not supported by dpscale's engine; use torch's class for it",
        )
    if isinstance(bucket_cap_mb, str) and bucket_cap_mb != "auto":
        raise ValueError(f"bucket_cap_mb must be a number of MiB or 'auto', got {bucket_cap_mb!r}")
    if mixed_precision is not None:
        _refuse("mixed_precision", "not supported; cast the module (e.g. autocast or .to(dtype)) instead")
    if bucket_cap_mb_list is not None:
        _refuse("bucket_cap_mb_list", "per-bucket sizes are not supported; pass bucket_cap_mb")
    if not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {dim!r}")
    if check_reduction:
        # torch ignores it too (the reducer always checks) and warns the same way
        warnings.warn(
            "The `check_reduction` argument in `DistributedDataParallel` module is deprecated. "
            "Please avoid using it.",
            FutureWarning,
            stacklevel=4,
        )


def _process_group(process_group, device_mesh) -> dist.ProcessGroup:
    """The group to reduce over: given, the device mesh's, or the default group."""
    if process_group is not None and device_mesh is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
        return device_mesh.get_group(mesh_dim=0)
    if process_group is not None:
        return process_group
    if not dist.is_initialized():
        raise ValueError(
            "torch.distributed is not initialized: call dist.init_process_group first "
            "(or pass process_group=)"
        )
    world = dist.group.WORLD  # the default group (public spelling of torch's _get_default_group())
    assert world is not None  # initialized
    return world


def _check_module(module: nn.Module, ignored: frozenset[str], device_ids, output_device) -> None:
    """torch's checks of the module and its devices, with torch's words."""
    params = [p for n, p in module.named_parameters() if n not in ignored]
    for p in params:
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise RuntimeError(
                "Modules with uninitialized parameters can't be used with `DistributedDataParallel`. "
                "Run a dummy forward pass to correctly initialize the modules"
            )
    if not any(p.requires_grad for p in params):
        raise RuntimeError(
            "DistributedDataParallel is not needed when a module doesn't have any parameter "
            "that requires a gradient."
        )
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError("device_ids can only be None or contain a single element.")
    device_types = {p.device.type for p in params}
    if len(device_types) != 1:
        raise ValueError(
            "DistributedDataParallel's input module must be on the same type of devices, but "
            f"input module parameters locate in {device_types}."
        )
    on_cpu = next(iter(device_types)) == "cpu"
    if on_cpu and (device_ids or output_device is not None):
        raise ValueError(
            "DistributedDataParallel device_ids and output_device arguments only work with "
            "single-device/multiple-device GPU modules or CPU modules, but got device_ids "
            f"{device_ids}, output_device {output_device}, and module parameters "
            f"{ {p.device for p in params} }."
        )
    if on_cpu and any(isinstance(m, nn.SyncBatchNorm) for m in module.modules()):
        raise ValueError("SyncBatchNorm layers only work with GPU modules")  # torch's check and words
    if device_ids and output_device is not None and _index(output_device) != _index(device_ids[0]):
        _refuse("output_device", "outputs stay on the module's device; pass output_device=device_ids[0]")


def _index(device) -> int | None:
    # None: a device without an index (torch.device("cuda")), which torch reads as the current one
    return device.index if isinstance(device, torch.device) else int(device)


def input_device(module: nn.Module, device_ids, ignored: set[str]) -> torch.device | None:
    """The device inputs are moved to (None: a CPU module, inputs stay where they are): torch's
    `device_ids`, for the single-device modules dpscale supports."""
    devices = {p.device for n, p in module.named_parameters() if n not in ignored}
    if len(devices) > 1:
        raise ValueError(
            f"module parameters span several devices {sorted(map(str, devices))}; "
            "dpscale supports single-device modules"
        )
    device = next(iter(devices), torch.device("cpu"))
    if device.type == "cpu":
        return None
    if not device_ids:
        return device
    index = _index(device_ids[0])
    return torch.device(device.type) if index is None else torch.device(device.type, index)


def move_to(obj: Any, device: torch.device) -> Any:
    """`obj` with its tensors moved to `device` (forward's inputs), as torch's DDP moves them:
    through tuples, lists and dicts, keeping namedtuples' and dicts' own types, and a
    PackedSequence as one (it is a namedtuple whose batch_sizes must stay on the CPU)."""
    if isinstance(obj, PackedSequence):
        # typed as Tensor.to's first overload only (a dtype); it takes a device as Tensor.to does
        return cast(Any, obj).to(device, non_blocking=True)
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(move_to(o, device) for o in obj))
    if isinstance(obj, tuple):
        return tuple(move_to(o, device) for o in obj)
    if isinstance(obj, list):
        return [move_to(o, device) for o in obj]
    if isinstance(obj, dict):
        out = copy.copy(obj)  # its own type: an OrderedDict, a defaultdict with its factory
        for k, v in obj.items():
            out[k] = move_to(v, device)
        return out
    return obj


def check_comm_hook(hook) -> None:
    """torch's checks on a communication hook, with torch's exception types and messages.

    An annotation, when present, must be torch's (`dist.GradBucket`, `Future[torch.Tensor]`) or
    dpscale's `GradBucket`; written as a string (postponed annotations) it is judged by its name.
    """
    if not callable(hook):
        raise TypeError("Communication hook must be callable.")
    params = inspect.signature(hook).parameters
    bucket = params["bucket"].annotation if "bucket" in params else inspect.Parameter.empty
    if bucket is not inspect.Parameter.empty and not _names(bucket, "GradBucket"):
        raise ValueError("Communication hook: bucket annotation should be dist.GradBucket.")
    ret = inspect.signature(hook).return_annotation
    if ret is not inspect.Signature.empty and ret != torch.futures.Future[torch.Tensor]:
        if not (isinstance(ret, str) and ret.replace(" ", "").endswith("Future[torch.Tensor]")):
            raise ValueError(
                "Communication hook: return annotation should be torch.futures.Future[torch.Tensor]."
            )


def _names(annotation, name: str) -> bool:
    if isinstance(annotation, str):
        return annotation.rsplit(".", 1)[-1] == name
    return getattr(annotation, "__name__", None) == name
