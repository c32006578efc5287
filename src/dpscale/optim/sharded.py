"""`ShardedOptimizer`: optimizer state partitioned across data-parallel workers (ZeRO stage 1).

Each of the W workers keeps the wrapped optimizer's state (Adam's two moments, SGD's momentum)
for 1/W of the parameters only. A step reduce-scatters the gradients, so each worker receives the
average over workers of its own part; updates that part with the wrapped optimizer; and
all-gathers the updated parameters. The bytes on the wire equal one all-reduce (reduce-scatter +
all-gather), and optimizer memory per worker falls by W (Rajbhandari et al., "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", SC 2020, stage P_os).

Usage: the model is *not* wrapped in DistributedDataParallel, since this optimizer does the
gradient reduction: every rank runs forward and backward on its own samples and calls `step()`.
A model that must stay wrapped (for DDP's buffer broadcast, say) registers `local_gradients_hook`
so that DDP leaves the gradients unreduced; that costs one extra copy of the gradients per step.

    model = build_model()  # the same on every rank; rank 0's values are broadcast
    opt = ShardedOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-3, weight_decay=0.1)
    for x, y in local_batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()  # local gradients; the mean over ranks is what is applied
        opt.step()
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from dpscale.comm import Transport, make_transport
from dpscale.comm.base import completed, global_rank
from dpscale.optim.layout import FlatLayout, element_keys, is_element_state, piece_state

# Partition: the flat parameter vector is cut into W equal contiguous ranges (`FlatLayout`), not
# whole parameters dealt out by size. A flat cut gives every worker exactly 1/W of the state and of
# the update work whatever the parameter sizes (a transformer's embedding and head alone are a
# large fraction of it, which a whole-parameter split cannot balance), and it makes reduce-scatter
# and all-gather single equal-part collectives. The price: the wrapped optimizer sees pieces of
# parameters (see layout.py), so it must act element-wise (SGD, Adam, AdamW, RMSprop, Adagrad do);
# one that needs a whole tensor (LAMB's per-parameter trust ratio, Adafactor's factored moments)
# would compute something else here.


class ShardedOptimizer(torch.optim.Optimizer, Joinable):
    """`optimizer_cls(params, **kwargs)` with its state split across the ranks of `process_group`.

    Collective: every rank constructs it with the same parameters, in the same order. All trainable
    parameters must share one dtype and device. Construction copies the parameters into one flat
    buffer (the parameters become views into it, so do not move the model afterwards) and
    broadcasts rank 0's values. `transport` ("auto", "gloo", "shm", ... or a Transport) carries
    the reduce-scatter and all-gather; "auto" uses shared memory for CPU workers on one host.

    Differences from the wrapped optimizer: gradients stay views into a flat buffer, so
    `zero_grad` zeroes them rather than setting them to None; and a parameter without a gradient
    counts as having a zero gradient (its state still advances): gradients are reduced as one flat
    buffer, so no rank knows whether another rank's backward reached that parameter.

    Joinable (torch's Join protocol, for uneven inputs): a rank that ran out of inputs keeps taking
    part in the others' steps with zero gradients, so every shard is still updated and gathered.
    """

    def __init__(
        self,
        optimizer_cls: type[torch.optim.Optimizer],
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        process_group: dist.ProcessGroup | None = None,
        transport: str | Transport | None = None,
        **kwargs: Any,
    ):
        super().__init__(params, dict(kwargs))  # validates the groups: no duplicates, leaves only
        Joinable.__init__(self)
        # position in torch's state_dict numbering -> index among the flattened (trainable) params;
        # frozen parameters keep their numbers but are neither flattened nor updated, as in torch
        self._flat_index: dict[int, int] = {}
        self._params: list[torch.Tensor] = []
        trainable: list[list[torch.Tensor]] = []
        position = 0
        for group in self.param_groups:
            trainable.append([])
            for p in group["params"]:
                if p.requires_grad:
                    self._flat_index[position] = len(self._params)
                    self._params.append(p)
                    trainable[-1].append(p)
                position += 1
        if not self._params:
            raise ValueError("ShardedOptimizer got no parameter that requires grad")
        kinds = sorted({f"{p.dtype} on {p.device}" for p in self._params})
        if len(kinds) > 1:
            raise ValueError(
                f"ShardedOptimizer needs all parameters of one dtype and device, got {', '.join(kinds)}; "
                "build one ShardedOptimizer per kind"
            )
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialized: call dist.init_process_group first")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        dtype, device = self._params[0].dtype, self._params[0].device
        self.transport: Transport = (
            make_transport(transport or "auto", process_group, device)
            if transport is None or isinstance(transport, str)
            else transport
        )
        self.layout = FlatLayout.build(trainable, self.world_size)

        n = self.layout.padded_numel
        self._flat_params = torch.zeros(n, dtype=dtype, device=device)
        # from the transport: shm reduce-scatters its own buffers without a staging copy
        self._flat_grads = self.transport.alloc(n, dtype, device)
        self._grad_views = []
        with torch.no_grad():
            for p, off in zip(self._params, self.layout.offsets, strict=True):
                view = self._flat_params[off : off + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view  # the all-gather then writes the parameters in place, no copy back
                grad = self._flat_grads[off : off + p.numel()].view_as(p)
                if p.grad is not None:
                    grad.copy_(p.grad)
                p.grad = grad  # backward accumulates into the flat buffer in place
                self._grad_views.append(grad)
            # Replicas start identical, as with DDP: rank 0's values win. Through the process group,
            # not the transport: shm would keep a staging copy of the whole vector for later use.
            src = global_rank(process_group, 0)
            dist.broadcast(self._flat_params, src=src, group=process_group)

        lo, hi = self._shard = self.layout.shard(self.rank)
        # One buffer of 1/W: the reduce-scatter's output (the shard's averaged gradient, which the
        # wrapped optimizer reads), then, once the update is done and the gradient is dead, the
        # all-gather's input. From the transport: shm gathers from the same place on every rank.
        self._shard_buffer = self.transport.alloc(hi - lo, dtype, device)
        self._pieces = self.layout.pieces(self.rank)
        self._piece_tensors = []
        inner_groups: dict[int, dict[str, Any]] = {}  # one per parameter group the shard touches
        for piece in self._pieces:
            t = self._flat_params[piece.lo : piece.hi]
            t.grad = self._shard_buffer[piece.lo - lo : piece.hi - lo]
            self._piece_tensors.append(t)
            if piece.group not in inner_groups:
                opts = {k: v for k, v in self.param_groups[piece.group].items() if k != "params"}
                inner_groups[piece.group] = {**opts, "params": []}
            inner_groups[piece.group]["params"].append(t)
        self._inner_group_of = list(inner_groups)  # outer group index of each inner group
        self.local_optimizer = optimizer_cls(list(inner_groups.values()), **kwargs)
        # the wrapped class's defaults fill our groups, so schedulers find every hyperparameter
        self.defaults = self.local_optimizer.defaults
        for group in self.param_groups:
            for k, v in self.defaults.items():
                group.setdefault(k, v)
        # the state this rank holds, keyed by its pieces (see `state_dict` for the full state)
        self.state = self.local_optimizer.state

    @torch.no_grad()
    def step(self, closure=None):
        """Reduce-scatter the gradients, update this rank's shard, all-gather the parameters (collective)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        Join.notify_join_context(self)  # under Join: this rank still trains (no-op otherwise)
        for p, view in zip(self._params, self._grad_views, strict=True):
            # backward normally accumulated into our view; DDP or the user may have replaced it
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view
        self._reduce_update_gather()
        return loss

    def _reduce_update_gather(self) -> None:
        self.transport.reduce_scatter(self._shard_buffer, self._flat_grads)
        self._shard_buffer.div_(self.world_size)
        self._sync_hyperparameters()
        self.local_optimizer.step()
        lo, hi = self._shard
        self._shard_buffer.copy_(self._flat_params[lo:hi])
        self.transport.all_gather(self._flat_params, self._shard_buffer)

    def join_hook(self, **kwargs) -> JoinHook:
        return _ShardedJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._flat_params.device

    @property
    def join_process_group(self):
        # the group object itself, not None: Join requires every joinable's to be the same one
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "local_optimizer"):  # construction adds the groups through here
            raise ValueError(
                "ShardedOptimizer lays out its parameters once, at construction; to add a group, "
                "build a new one from state_dict() (or pass every group up front, frozen ones included)"
            )
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero all gradients; they stay views into the flat buffer whatever `set_to_none` says."""
        self._flat_grads.zero_()
        for p, view in zip(self._params, self._grad_views, strict=True):
            p.grad = view

    def _sync_hyperparameters(self) -> None:
        # schedulers and users change our groups; the wrapped optimizer must see the same values
        for g, inner in zip(self._inner_group_of, self.local_optimizer.param_groups, strict=True):
            inner.update((k, v) for k, v in self.param_groups[g].items() if k != "params")

    def _state_pieces(self):
        """(piece, tensor) for the pieces that lie in parameters: padding's state is never saved."""
        return [(p, t) for p, t in zip(self._pieces, self._piece_tensors, strict=True) if p.param is not None]

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The full, unsharded state in torch's format (collective; every rank gets all of it).

        Per-parameter tensors shaped like the parameters, keyed by parameter index as
        `torch.optim.Optimizer.state_dict()` does, so it loads into this optimizer at any world
        size and into the plain wrapped optimizer, and plain optimizers' state loads here. It holds
        only tensors, numbers, strings, tuples, lists and dicts: safe for weights_only loading.
        """
        lo, hi = self._shard
        # Which keys each parameter has, with the scalar values: gathered, because a parameter may
        # lie in several shards or in another rank's, and every rank must issue the same all-gathers.
        held: dict[int, dict[str, tuple]] = {}
        for piece, t in self._state_pieces():
            for k, v in self.local_optimizer.state.get(t, {}).items():
                kind = ("element", v.dtype) if is_element_state(v, t.numel()) else ("scalar", v)
                held.setdefault(piece.param, {}).setdefault(k, kind)
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, held, group=self.process_group)
        merged: dict[int, dict[str, tuple]] = {}
        for rank_held in everyone:
            for i, keys in rank_held.items():
                for k, kind in keys.items():
                    merged.setdefault(i, {}).setdefault(k, kind)
        dtypes = {k: kind[1] for keys in merged.values() for k, kind in keys.items() if kind[0] == "element"}
        full: dict[str, torch.Tensor] = {}
        for k in sorted(dtypes):  # the same order on every rank
            shard = torch.zeros(hi - lo, dtype=dtypes[k], device=self._flat_params.device)
            for piece, t in self._state_pieces():
                if k in self.local_optimizer.state.get(t, {}):
                    shard[piece.lo - lo : piece.hi - lo].copy_(self.local_optimizer.state[t][k])
            full[k] = torch.empty(self.layout.padded_numel, dtype=dtypes[k], device=shard.device)
            self.transport.all_gather(full[k], shard)
        state: dict[int, dict[str, Any]] = {}
        for pos, i in self._flat_index.items():
            p, off = self._params[i], self.layout.offsets[i]
            if i in merged:
                state[pos] = {
                    k: full[k][off : off + p.numel()].view_as(p) if kind[0] == "element" else _copy(kind[1])
                    for k, kind in merged[i].items()
                }
        groups, start = [], 0
        for group in self.param_groups:
            n = len(group["params"])
            groups.append(
                {**{k: v for k, v in group.items() if k != "params"}, "params": list(range(start, start + n))}
            )
            start += n
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state (from `state_dict()` at any world size, or from the plain wrapped optimizer).

        Each rank cuts its own shard from it; no communication.
        """
        saved_groups = state_dict["param_groups"]
        ours = [len(g["params"]) for g in self.param_groups]
        theirs = [len(g["params"]) for g in saved_groups]
        if ours != theirs:
            raise ValueError(
                f"optimizer state has parameter groups of sizes {theirs}, this optimizer has {ours}; "
                "load a state saved for the same parameters and groups"
            )
        position = {idx: pos for pos, idx in enumerate(i for g in saved_groups for i in g["params"])}
        full_state = {
            self._flat_index[position[idx]]: st
            for idx, st in state_dict["state"].items()
            if position[idx] in self._flat_index
        }
        shapes = [p.shape for p in self._params]
        elements = element_keys(full_state, shapes)
        for i, st in full_state.items():
            for k in elements & st.keys():
                if st[k].shape != shapes[i]:
                    raise ValueError(
                        f"optimizer state {k!r} of parameter #{i} has shape {list(st[k].shape)}, the "
                        f"parameter has {list(shapes[i])}; load a state saved for the same model"
                    )
        self.local_optimizer.state.clear()
        for piece, t in zip(self._pieces, self._piece_tensors, strict=True):
            if st := piece_state(self.layout, piece, full_state, elements, t):
                self.local_optimizer.state[t] = st
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            group.update((k, v) for k, v in saved.items() if k != "params")
        self._sync_hyperparameters()


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensor state the optimizer holds in this process (a ShardedOptimizer: this rank's shard)."""
    return sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


class _ShardedJoinHook(JoinHook):
    """On a rank that joined: the step of the ranks still training, with a zero gradient."""

    def __init__(self, optimizer: ShardedOptimizer):
        self.optimizer = optimizer

    @torch.no_grad()
    def main_hook(self) -> None:
        opt = self.optimizer
        saved = opt._flat_grads.clone()  # the joined rank's own gradients come back afterwards
        opt._flat_grads.zero_()
        opt._reduce_update_gather()
        opt._flat_grads.copy_(saved)


# unannotated: torch's DDP refuses a hook whose annotations are not dist.GradBucket and Future[Tensor]
def local_gradients_hook(state, bucket):
    """A DDP comm hook that leaves each rank's gradients unreduced.

    For a model that stays wrapped in DistributedDataParallel while a ShardedOptimizer reduces its
    gradients: `ddp.register_comm_hook(None, local_gradients_hook)`.
    """
    return completed(bucket.buffer())
