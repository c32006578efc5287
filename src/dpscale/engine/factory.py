"""Every data-parallel engine dpscale can run, by name, and the one factory that builds them.

Training (`TrainConfig.engine.name`), the benches (`--engines`) and the performance model's profile
all pick from this table, so a new engine (or a new transport pinned to an engine) is one entry:

- `dpscale`: this project's DistributedDataParallel (transport "auto": shared memory on one host).
- `dpscale-gloo`: the same engine forced onto gloo, torch DDP's transport: engine against engine.
- `dpscale@shm`: the same engine forced onto shared memory; profiled by `dpscale profile` as the
  engine's own bookkeeping without gloo's thread hand-offs.
- `torch`: torch.nn.parallel.DistributedDataParallel, the reference users would pick instead.
- `local`: the bare model, never synchronized: the compute ceiling a data-parallel engine can
  approach but not beat.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from dpscale.engine.ddp import DistributedDataParallel
from dpscale.errors import ConfigError


@dataclass(frozen=True)
class EngineSpec:
    name: str
    description: str
    kind: str  # "dpscale", "torch" or "local": which wrapper `wrap` builds
    transport: str | None  # the transport this entry pins dpscale to; None: the caller's choice
    # where it is offered: "train", "bench", "compare" (the benches' default set), "profile",
    # "run" (the stand-in for torch's DDP in `dpscale run` and `dpscale scale`)
    uses: tuple[str, ...]


_EVERYWHERE = ("train", "bench", "compare", "profile", "run")
_SPECS = (
    EngineSpec("dpscale", "dpscale's engine, transport auto", "dpscale", None, _EVERYWHERE),
    EngineSpec("torch", "torch.nn.parallel.DistributedDataParallel", "torch", None, _EVERYWHERE),
    EngineSpec("local", "the bare model, never synchronized", "local", None, ("bench", "compare")),
    EngineSpec("dpscale-gloo", "dpscale's engine on gloo, torch's transport", "dpscale", "gloo", ("bench",)),
    EngineSpec("dpscale@shm", "dpscale's engine on shared memory", "dpscale", "shm", ()),
)
ENGINES: dict[str, EngineSpec] = {s.name: s for s in _SPECS}


def engines_for(use: str) -> tuple[str, ...]:
    """Names offered for `use` ("train", "bench", "compare", "profile", "run"), in the table's order."""
    return tuple(s.name for s in _SPECS if use in s.uses)


TRAIN_ENGINES = engines_for("train")
BENCH_ENGINES = engines_for("bench")
DEFAULT_BENCH_ENGINES = engines_for("compare")
PROFILE_ENGINES = engines_for("profile")
RUN_ENGINES = engines_for("run")
DPSCALE_ON_SHM = "dpscale@shm"


def wrap(
    model: nn.Module,
    engine: str,
    *,
    device_ids: list[int] | None = None,
    process_group: dist.ProcessGroup | None = None,
    bucket_cap_mb: float = 25.0,
    gradient_as_bucket_view: bool = True,
    **dpscale_options,
) -> nn.Module:
    """`model` wrapped by `engine`; `dpscale_options` (transport, collective_timeout_s, ...) go to
    dpscale's DistributedDataParallel only, and an entry's pinned transport wins over theirs.

    `gradient_as_bucket_view` goes to both DDPs alike. True here (torch's default is False):
    dpscale's loops, benches and profiles own their optimizer step and keep no gradient past it,
    so the copy of every reduced gradient back into a tensor of its own would be pure cost, and
    the engines are compared on the same setting.
    """
    spec = ENGINES.get(engine)
    if spec is None:
        raise ConfigError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
    if spec.kind == "dpscale":
        if spec.transport is not None:
            dpscale_options["transport"] = spec.transport
        return DistributedDataParallel(
            model,
            device_ids,
            process_group=process_group,
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
            **dpscale_options,
        )
    if spec.kind == "torch":
        return nn.parallel.DistributedDataParallel(
            model,
            device_ids,
            process_group=process_group,
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
        )
    return model


def parse_engines(text: str, choices: tuple[str, ...] = BENCH_ENGINES) -> list[str]:
    """Read "dpscale,torch" as a list; ValueError naming --engines for an unknown name or none."""
    names = [e.strip() for e in text.split(",") if e.strip()]
    bad = [e for e in names if e not in choices]
    if bad or not names:
        raise ConfigError(f"--engines: unknown {bad or text!r}; choose from {', '.join(choices)}")
    return names
