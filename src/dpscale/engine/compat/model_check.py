"""What the engine checks and copies once, before training: the same model on every rank.

`check_same_model` names the first parameter or bucket that differs between ranks (a mismatch
would otherwise hang the first per-bucket collective); `broadcast_coalesced` makes the replicas
identical; `sparse_gradient_params` finds the parameters whose gradients are sparse tensors.
Collectives go through the group object itself, so a ProcessGroup that was never registered with
init_process_group (one implemented in Python, say) works as well as the default group; the
signatures travel on the group's device (comm/group_device.py: NCCL takes no CPU tensor).
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import AllgatherOptions

from dpscale.comm.base import group_size, wait_work
from dpscale.comm.group_device import backend_devices, collective_device
from dpscale.engine.collective_log import CollectiveLog


def sparse_gradient_params(module: nn.Module, params: list[torch.Tensor], group) -> set[int]:
    """Indices into `params` of the weights of Embedding/EmbeddingBag(sparse=True) (as torch does).

    ValueError when `group` cannot reduce them: NCCL all-reduces no sparse tensor, and a
    collective that fails at the first backward would leave the ranks hung or half-stepped.
    """
    sparse = {
        id(m.weight) for m in module.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
    }
    found = {k for k, p in enumerate(params) if id(p) in sparse}
    if found and collective_device(group).type != "cpu":
        backends = ", ".join(sorted(set(backend_devices(group).values())))
        raise ValueError(
            f"sparse gradients (Embedding/EmbeddingBag with sparse=True) cannot be reduced by {backends}, "
            "which reduces dense GPU tensors only; build the embeddings with sparse=False or use gloo"
        )
    return found


def check_same_model(
    module: nn.Module,
    group,
    buckets: list[list[str]] | None = None,
    log: CollectiveLog | None = None,
) -> None:
    """Every rank must hold the same parameters and bucket layout; name the first difference."""
    sig = [(n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()]
    if log is not None:
        log.record("all_gather_object", "model signature")
    sigs = _all_gather_object((sig, buckets), group)
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


def _all_gather_object(obj, group) -> list:
    world = group_size(group)
    if world == 1:
        return [obj]
    device = collective_device(group)  # NCCL takes no CPU tensor
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    size = torch.tensor([data.numel()], device=device)
    wait_work(group.allgather([sizes], [size], AllgatherOptions()))
    lengths = torch.cat(sizes).tolist()  # one trip to the host
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    wait_work(group.allgather([out], [padded], AllgatherOptions()))
    rows = torch.stack(out).cpu()
    return [pickle.loads(row[:n].numpy().tobytes()) for row, n in zip(rows, lengths, strict=True)]


def _describe_buckets(buckets: list[list[str]]) -> str:
    text = "; ".join(", ".join(b) for b in buckets[:3])
    return text + ("; ..." if len(buckets) > 3 else "")


def _describe(sig) -> str:
    if sig is None:
        return "no such parameter"
    name, shape, dtype = sig
    return f"{name!r} of shape {list(shape)} and {dtype.removeprefix('torch.')}"


# torch's DDP broadcasts the initial state in messages of this size: one flat copy of the whole
# model would double its memory at the peak, on a GPU the difference between fitting and not
BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


@torch.no_grad()
def broadcast_coalesced(
    tensors: list[torch.Tensor],
    group,
    src: int = 0,
    *,
    log: CollectiveLog | None = None,
    what: str = "",
    bucket_bytes: int = BROADCAST_BUCKET_BYTES,
) -> None:
    """Broadcast `tensors` from group rank `src`: one message per dtype and device and at most
    `bucket_bytes` of them (a larger tensor alone, in place), not one per tensor."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    for ts in _broadcast_buckets(tensors, bucket_bytes):
        alone = len(ts) == 1 and ts[0].is_contiguous()
        flat = ts[0] if alone else torch.cat([t.reshape(-1) for t in ts])
        if log is not None:
            log.record("broadcast", what, flat)
        wait_work(group.broadcast([flat], opts))
        if alone:
            continue
        off = 0
        for t in ts:
            t.copy_(flat[off : off + t.numel()].view_as(t))
            off += t.numel()


def _broadcast_buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    by_kind: dict[tuple, list[list[torch.Tensor]]] = {}
    filled: dict[tuple, int] = {}  # bytes in each kind's last bucket
    for t in tensors:
        kind = (t.device, t.dtype)
        buckets = by_kind.setdefault(kind, [[]])
        nbytes = t.numel() * t.element_size()
        if buckets[-1] and filled[kind] + nbytes > bucket_bytes:
            buckets.append([])
            filled[kind] = 0
        buckets[-1].append(t)
        filled[kind] = filled.get(kind, 0) + nbytes
    return [b for buckets in by_kind.values() for b in buckets]
