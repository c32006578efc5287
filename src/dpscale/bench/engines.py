"""Wrap one model the way each compared engine would, so benchmarks differ only in the engine.

- `dpscale`: this project's DistributedDataParallel (transport "auto": shared memory on one host).
- `dpscale-gloo`: the same engine forced onto gloo, torch DDP's transport: engine against engine.
- `torch`: torch.nn.parallel.DistributedDataParallel, the reference users would pick instead.
- `local`: the bare model, never synchronized: the compute ceiling a data-parallel engine can
  approach but not beat.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ..engine import DistributedDataParallel

ENGINES = ("dpscale", "torch", "local")  # the default comparison
ALL_ENGINES = (*ENGINES, "dpscale-gloo")


def wrap(
    model: nn.Module,
    engine: str,
    *,
    process_group: dist.ProcessGroup | None = None,
    bucket_cap_mb: float = 25.0,
) -> nn.Module:
    if engine in ("dpscale", "dpscale-gloo"):
        transport = "gloo" if engine == "dpscale-gloo" else "auto"
        return DistributedDataParallel(
            model, process_group=process_group, bucket_cap_mb=bucket_cap_mb, transport=transport
        )
    if engine == "torch":
        return nn.parallel.DistributedDataParallel(
            model, process_group=process_group, bucket_cap_mb=bucket_cap_mb
        )
    if engine == "local":
        return model
    raise ValueError(f"unknown engine {engine!r}; choose from {', '.join(ALL_ENGINES)}")


def parse_engines(text: str) -> list[str]:
    names = [e.strip() for e in text.split(",") if e.strip()]
    bad = [e for e in names if e not in ALL_ENGINES]
    if bad or not names:
        raise ValueError(f"--engines: unknown {bad or text!r}; choose from {', '.join(ALL_ENGINES)}")
    return names
