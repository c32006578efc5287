"""Uneven inputs: torch's Join protocol for dpscale's engine.

Under `torch.distributed.algorithms.Join([model, ...])` (or `model.join()`), a rank that runs out
of inputs leaves its loop and enters the context manager's exit, which calls `DDPJoinHook.main_hook`
once per iteration that the other ranks still run. The hook issues the same collectives, in the
same order, as a training rank's forward and backward, with zeros for its gradients; once every
rank has joined, `post_hook` copies the model of a rank that joined last to everyone.

A training rank's forward, when joining is enabled, in this order (the hook mirrors each):
  1. notify the context (an all-reduce of ones; the joined rank counts those, see torch's Join),
  2. if buffers are synced: agree on a rank that is still training (all-reduce MAX), broadcast
     its buffers,
  3. announce whether this step's backward synchronizes (all-reduce of 1 or 0),
  4. in backward: each bucket's reduction through the transport or the comm hook, each sparse
     gradient, and the used-parameter flags when parameters may go unused.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from dpscale.comm.base import group_rank
from dpscale.comm.group_device import collective_device
from dpscale.engine.compat.model_check import broadcast_coalesced
from dpscale.engine.hooks import GradBucket


def notify(ddp, sync_grads: bool) -> None:
    """Step 1, on a training rank; also sets the gradient divisor for this step."""
    work = Join.notify_join_context(ddp)
    reducer = ddp.reducer
    if work is not None and not ddp._divide_by_initial_world_size:
        # gradients are averaged over the ranks still training (notify's all-reduce counts them)
        work.wait()
        reducer.divisor = int(work.get_future().value()[0].item())
    else:
        reducer.divisor = reducer.world_size


def authoritative_rank(ddp, candidate: bool) -> int:
    """The highest rank among those that offer themselves (-1 from the others)."""
    group = ddp.process_group
    rank = torch.tensor([group_rank(group) if candidate else -1], device=collective_device(group))
    dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=ddp.process_group)
    return int(rank.item())


def announce_backward_sync(ddp, sync: bool) -> bool:
    """Step 3: whether any rank's backward synchronizes this step."""
    flag = torch.tensor([1.0 if sync else 0.0], device=collective_device(ddp.process_group))
    dist.all_reduce(flag, group=ddp.process_group)
    return bool(flag.item() != 0)


class DDPJoinHook(JoinHook):
    def __init__(self, ddp, divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        if ddp.will_sync_module_buffers():
            src = authoritative_rank(ddp, candidate=False)
            broadcast_coalesced(ddp.modules_buffers, ddp.process_group, src, what="buffers (joined)")
        sync = announce_backward_sync(ddp, False)
        ddp.require_forward_param_sync = sync
        if sync:
            _shadow_backward(ddp.reducer)

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        src = authoritative_rank(ddp, candidate=is_last_joiner)
        state = [p.detach() for n, p in ddp.module.named_parameters() if n not in ddp.parameters_to_ignore]
        if ddp.forward_sync_buffers:
            state += ddp.modules_buffers
        broadcast_coalesced(state, ddp.process_group, src, what="final model (join)")


def _shadow_backward(reducer) -> None:
    """Step 4 on a joined rank: the reductions of a backward, contributing zeros."""
    futures = []
    # the buckets' own buffers, zeroed for the reduction and restored after: a transport may
    # reduce only buffers it allocated (shm stages others through a collective allocation)
    kept = [b.buffer.clone() for b in reducer.buckets]
    for b in reducer.buckets:
        b.buffer.zero_()
        if reducer.comm_hook is None:
            futures.append(reducer.transport.all_reduce(b.buffer))
        else:
            state, hook = reducer.comm_hook
            params = [reducer.params[i] for i in b.param_indices]
            is_last = b.index == len(reducer.buckets) - 1
            futures.append(hook(state, GradBucket(b.index, b.buffer, params, b.views, b.offsets, is_last)))
    saved = [(p, p.grad) for p in (reducer.params[i] for i in reducer.sparse_indices)]
    for k, (p, _) in enumerate(saved):
        p.grad = None  # reduced as an empty sparse gradient
        futures.append(reducer._reduce_sparse(reducer.sparse_indices[k], k))
    for p, grad in saved:
        p.grad = grad
    if reducer.find_unused_parameters or reducer.static_graph:
        device = collective_device(reducer.process_group)
        flags = torch.zeros(len(reducer.params), dtype=torch.int32, device=device)
        dist.all_reduce(flags, group=reducer.process_group)
    for fut in futures:
        fut.wait()
    for b, buffer in zip(reducer.buckets, kept, strict=True):
        b.buffer.copy_(buffer)
