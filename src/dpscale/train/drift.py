"""Replica drift check: do all ranks still hold bit-identical parameters?

Data parallelism keeps replicas identical only if every rank applies the same update. A custom
hook, a rank-dependent branch in user code, or a hardware fault can break that silently, and
the run goes on training W different models. Every `drift_check_every` steps the trainer
compares a fingerprint of every parameter and buffer across ranks and stops at the first
difference, naming the tensor and the ranks.

The fingerprint of a tensor is the sum of its bytes read as 64-bit integers, wrapping modulo
2^64. Integer addition is associative, so it is exact whatever order or thread count a rank
uses: equal tensors give equal fingerprints, and any single changed element changes it. It is
compared without tolerance, and it runs at memory bandwidth (about 2 ms for the 25 MB `mlp` on
one core; the check's cost is in docs/fault-tolerance.md). Only on a mismatch are the float64
sums of the differing tensor gathered, to show how far apart the ranks are.

BatchNorm running statistics are left out: each rank updates them from its own batches between
the engine's buffer broadcasts, so they differ by design (as in torch's DDP).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dpscale.comm.base import all_gather_into
from dpscale.comm.group_device import on_collective_device
from dpscale.engine.collective_log import CollectiveLog


class ReplicaDriftError(RuntimeError):
    """Ranks hold different parameters or buffers; names the first one and the ranks."""


def checked_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters, then buffers, in registration order, without BatchNorm running statistics."""
    skip = set()
    for prefix, sub in module.named_modules():
        # torch's batch and instance norms (their private base class _NormBase) are the modules
        # with `track_running_stats`; asked by that public attribute, not by the private class
        if hasattr(sub, "track_running_stats"):
            skip |= {f"{prefix}.running_mean".lstrip("."), f"{prefix}.running_var".lstrip(".")}
    named = list(module.named_parameters()) + list(module.named_buffers())
    return [(n, t) for n, t in named if n not in skip]


@torch.no_grad()
def fingerprint(tensors: list[torch.Tensor]) -> torch.Tensor:
    """int64 tensor with one entry per tensor: its bytes summed as int64 words, modulo 2^64.

    Computed where the tensors live, with no trip to the host (int64 addition wraps modulo 2^64).
    """
    sums = []
    for t in tensors:
        raw = t.detach().reshape(-1).view(torch.uint8)
        n = raw.numel() // 8 * 8
        try:
            words = raw[:n].view(torch.int64)
        except RuntimeError:  # a view whose storage offset is not 8-byte aligned
            words = raw[:n].clone().view(torch.int64)
        sums.append(words.sum() + raw[n:].sum(dtype=torch.int64))
    return torch.stack(sums) if sums else torch.empty(0, dtype=torch.int64)


@torch.no_grad()
def check_replicas(
    module: nn.Module,
    process_group: dist.ProcessGroup | None = None,
    *,
    step: int,
    log: CollectiveLog | None = None,
) -> None:
    """Collective: raise ReplicaDriftError on every rank if any rank's replica differs from rank 0's.

    One all-gather of one tensor and one trip to the host, whatever the number of tensors.
    """
    named = checked_tensors(module)
    local = fingerprint([t for _, t in named])
    gathered = _all_gather(local, process_group, log, "replica fingerprints")
    differs = (gathered[1:] != gathered[0]).any(dim=0)
    if not differs.any():
        return
    # every rank compared the same gathered values, so every rank is here: one more collective is safe
    first = int(differs.nonzero()[0])
    name, tensor = named[first]
    value_sum = tensor.detach().sum(dtype=torch.float64).reshape(1)
    sums = _all_gather(value_sum, process_group, log, f"value sums of {name}")
    ranks = [r for r in range(len(gathered)) if gathered[r, first] != gathered[0, first]]
    shown = ", ".join(f"rank {r}: sum {float(sums[r]):.9g}" for r in [0, *ranks])
    raise ReplicaDriftError(
        f"replicas drifted by step {step}: {name!r} on rank{'s' if len(ranks) > 1 else ''} "
        f"{', '.join(map(str, ranks))} differs from rank 0 ({shown}); {int(differs.sum())} of "
        f"{len(named)} parameters and buffers differ. Every rank must apply the same update: look "
        "for code that changes weights outside the synchronized step or depends on the rank"
    )


def _all_gather(t: torch.Tensor, group, log: CollectiveLog | None, what: str) -> torch.Tensor:
    """Every rank's `t` as the rows of one CPU tensor: staged on the group's device (NCCL takes no
    CPU tensor), gathered there, brought to the host once."""
    staged = on_collective_device(t, group)
    gathered = staged.new_empty((dist.get_world_size(group), *t.shape))
    if log is not None:
        log.record("all_gather", what, staged)
    all_gather_into(gathered, staged, group)
    return gathered.cpu()
