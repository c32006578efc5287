"""Choosing a transport: `auto` picks the fastest one that fits where the workers run.

- CUDA tensors: the process group itself (NCCL).
- CPU workers all on one host: `shm` (on x86-64; elsewhere gloo, see `shm_is_safe`).
- CPU workers on several hosts: `hierarchical` (shm within hosts, gloo between).
- `gloo` forces the plain process group.

Workers are on the same host when they share a hostname and the same /dev/shm; the
environment variable DPSCALE_HOST_ID overrides that (to emulate hosts in tests, or when
hostnames do not tell hosts apart).
"""

from __future__ import annotations

import os
import platform
import socket
import sys

import torch
import torch.distributed as dist

from dpscale.comm.base import is_registered
from dpscale.comm.hierarchical import HierarchicalTransport
from dpscale.comm.process_group import ProcessGroupTransport
from dpscale.comm.shm import SharedMemoryTransport
from dpscale.errors import ConfigError

TRANSPORT_NAMES = ("auto", "gloo", "nccl", "shm", "hierarchical")


def shm_is_safe() -> bool:
    """The shm barriers use plain stores and loads, which order data and flag on x86-64 only
    (total store order); on weaker memory models (Arm) a peer could see the flag before the data.
    Its segments are memfds shared through /proc (Linux only)."""
    return platform.machine().lower() in ("x86_64", "amd64") and hasattr(os, "memfd_create")


def host_id() -> str:
    if os.environ.get("DPSCALE_HOST_ID"):
        return os.environ["DPSCALE_HOST_ID"]
    try:
        st = os.stat("/dev/shm")
        shm = f"{st.st_dev}:{st.st_ino}"
    except FileNotFoundError:
        shm = "no-shm"
    return f"{socket.gethostname()}/{shm}"


def make_transport(
    name: str,
    process_group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    *,
    timeout_s: float = 300.0,
):
    """Build the transport `name` over `process_group` (collective: every rank must call it)."""
    if name not in TRANSPORT_NAMES:
        raise ConfigError(f"transport: unknown {name!r}; choose one of {', '.join(TRANSPORT_NAMES)}")
    is_cuda = device is not None and torch.device(device).type == "cuda"
    if name in ("gloo", "nccl") or is_cuda:
        if is_cuda and name in ("shm", "hierarchical"):
            raise ConfigError(
                f"transport {name!r} reduces CPU tensors; use 'auto' or 'nccl' for a CUDA model"
            )
        return ProcessGroupTransport(process_group)
    if name == "shm" and not shm_is_safe():
        raise ConfigError(
            f"transport 'shm' relies on x86-64 memory ordering and Linux memfds; this is "
            f"{platform.machine()} {sys.platform}: use 'gloo'"
        )
    world = dist.get_world_size(process_group)
    if name == "auto" and (world == 1 or not is_registered(process_group)):
        # nothing to reduce with anyone; or a group built by hand, whose members shm cannot find
        return ProcessGroupTransport(process_group)
    if not is_registered(process_group):
        raise ConfigError(
            f"transport {name!r} needs a group made by torch.distributed (init_process_group or "
            "new_group); for a ProcessGroup built by hand use 'auto' or 'gloo'"
        )
    hosts: list = [None] * world
    dist.all_gather_object(hosts, host_id(), group=process_group)
    one_host = len(set(hosts)) == 1
    if name == "shm" and not one_host:
        raise ConfigError(
            f"transport 'shm' needs every worker on one host, but they run on {len(set(hosts))}; "
            "use 'auto' or 'hierarchical'"
        )
    if name == "auto" and not shm_is_safe():
        return ProcessGroupTransport(process_group)
    if name == "shm" or (name == "auto" and one_host):
        return SharedMemoryTransport(process_group, timeout_s=timeout_s)
    return HierarchicalTransport(process_group, hosts, timeout_s=timeout_s)
