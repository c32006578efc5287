"""Where a process group's collectives need their tensors: the CPU, or the current GPU.

NCCL reduces CUDA tensors only: a small CPU tensor of metadata (flags, sizes, fingerprints)
handed to an NCCL group raises "No backend type associated with device type cpu". Every
collective of metadata therefore builds its tensor on `collective_device(group)` (or stages it
there with `on_collective_device`), whatever device the model is on: the CPU when the group has
a CPU backend (gloo alone, or gloo beside NCCL as in "cpu:gloo,cuda:nccl"), else the current
accelerator. tests/comm/test_group_device.py checks that every such caller in dpscale does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dpscale.comm.base import is_registered

# backends that take no CPU tensor, for a group whose backend is named without its devices
_ACCELERATOR_ONLY = {"nccl": "cuda", "xccl": "xpu"}


def backend_devices(group) -> dict[str, str]:
    """Device type -> backend name of `group` (None: the default group), e.g. {"cuda": "nccl"}."""
    if not is_registered(group):
        # a group built by hand (a ProcessGroup written in Python) names its one backend itself
        name = group.name().lower()
        return {_ACCELERATOR_ONLY[name]: name} if name in _ACCELERATOR_ONLY else {"cpu": name}
    config = str(dist.get_backend_config(group))
    if ":" not in config:
        name = config.lower()
        return {_ACCELERATOR_ONLY[name]: name} if name in _ACCELERATOR_ONLY else {"cpu": name}
    pairs = (part.split(":", 1) for part in config.split(","))
    return {device.strip(): backend.strip() for device, backend in pairs}


def collective_device(group) -> torch.device:
    """The device of the tensors `group`'s collectives take (see the module's docstring)."""
    devices = backend_devices(group)
    if "cpu" in devices:
        return torch.device("cpu")
    kind = next(iter(devices))
    if kind == "cuda" and torch.cuda.is_available():
        # the device this worker selected (train/device.py, torch.cuda.set_device), as torch's
        # own object collectives use
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def on_collective_device(tensor: torch.Tensor, group) -> torch.Tensor:
    """`tensor` itself when it already lives where `group`'s collectives need it, else a copy there."""
    return tensor.to(collective_device(group))
