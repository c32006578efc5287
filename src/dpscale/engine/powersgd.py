"""PowerSGD: low-rank gradient compression as a communication hook.

Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019. Each gradient matrix M (n x m; a tensor with more dimensions is
viewed as shape[0] x the rest) is replaced by a rank-r approximation found by one step of power
iteration, started from the previous step's Q (warm start), with error feedback:

    M  <- M + e               add back what compression dropped on this rank last step
    P   = M Q                 n x r, all-reduced
    P^  = orthonormal basis of the columns of P      (the same on every rank: so is P)
    Q_w = M^T P^              m x r, all-reduced and averaged: Q = mean_w Q_w
    e   = M - P^ Q_w^T        this rank's compression error, kept for the next step
    result = P^ Q^T           = P^ P^^T mean_w(M), the averaged gradient projected on span(P^)

P needs no averaging: an orthonormal basis does not depend on the scale. Per matrix a rank sends
(n + m) r numbers instead of n m. Vectors (biases, norm weights) and matrices that would not shrink
by `min_compression_rate` are all-reduced uncompressed, in the same message as the Ps.

Error feedback makes the compression lossless over time: with e_0 = 0, after K compressed steps
    sum_k result_k + mean_w e_{w,K} = sum_k mean_w gradient_{w,k},
so whatever a step leaves out is applied later, not lost (the paper's Algorithm 2).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from dpscale.comm.base import completed


class PowerSGDState:
    """What `powersgd_hook` keeps between steps, and its settings.

    - `rank`: the approximation rank r (not a process rank). The paper finds r = 2 enough to match
      uncompressed SGD on its image and language models; larger r approximates more closely and
      sends more.
    - `start_iter`: steps all-reduced uncompressed before compression starts. Early gradients are
      large and change direction fast, so a warm-started Q lags and the error is largest; a few
      exact steps there cost little.
    - `min_compression_rate`: compress a matrix only if n m >= this * (n + m) r: a small one gains
      too little for its extra latency and error.
    - `use_error_feedback`, `warm_start`: the paper's two ingredients; off only to study them.
    - `seed`: the initial Qs; every rank must draw the same ones, hence a generator of our own.

    Measurements: `last_step_bytes` (what this rank contributed to the step's all-reduces),
    `last_step_uncompressed_bytes` (what plain averaging would have sent), `total_bytes`.
    Q and the errors are kept per parameter, so they survive a change of the bucket layout, and
    `state_dict` / `load_state_dict` carry them through a checkpoint (the trainer saves every
    rank's, since errors differ per rank), so a resumed run compresses from its first step.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        rank: int = 2,
        start_iter: int = 10,
        min_compression_rate: float = 2.0,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        seed: int = 0,
    ):
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank (the approximation rank) must be an integer >= 1, got {rank!r}")
        if not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"start_iter must be an integer >= 0, got {start_iter!r}")
        if not min_compression_rate >= 0:
            raise ValueError(f"min_compression_rate must be >= 0, got {min_compression_rate!r}")
        self.process_group = process_group
        self.rank = rank
        self.start_iter = start_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.iteration = 0
        self.q: dict[torch.Tensor, torch.Tensor] = {}  # parameter -> Q (m x r) of the last step
        self.errors: dict[torch.Tensor, torch.Tensor] = {}  # parameter -> this rank's e (n x m)
        self.last_step_bytes = 0
        self.last_step_uncompressed_bytes = 0
        self.total_bytes = 0
        self._step_bytes = 0
        self._step_uncompressed_bytes = 0
        self._generator = torch.Generator().manual_seed(seed)

    # -- checkpoints: per parameter name, since Parameter objects do not survive a restart --------
    def state_dict(self, named_parameters: Iterable[tuple[str, torch.Tensor]]) -> dict:
        """This rank's Qs, errors and step count, keyed by parameter name (CPU tensors)."""
        names = {param: name for name, param in named_parameters}
        return {
            "iteration": self.iteration,
            "total_bytes": self.total_bytes,
            "q": {names[p]: q.detach().cpu() for p, q in self.q.items()},
            "errors": {names[p]: e.detach().cpu() for p, e in self.errors.items()},
            "generator": self._generator.get_state(),
        }

    def load_state_dict(self, state: dict, named_parameters: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Restore `state_dict`'s output onto these parameters; ValueError naming what does not fit."""
        params = dict(named_parameters)
        if not isinstance(state, dict) or not {"iteration", "q", "errors"} <= set(state):
            raise ValueError("PowerSGD state must be a dict with iteration, q and errors")
        iteration = state["iteration"]
        if type(iteration) is not int or iteration < 0:
            raise ValueError(f"PowerSGD state: iteration is {iteration!r}, not a count")
        q: dict[torch.Tensor, torch.Tensor] = {}
        errors: dict[torch.Tensor, torch.Tensor] = {}
        for kind, saved, out in (("q", state["q"], q), ("errors", state["errors"], errors)):
            for name, tensor in dict(saved).items():
                param = params.get(name)
                if param is None or not isinstance(tensor, torch.Tensor):
                    raise ValueError(f"PowerSGD state: {kind} for {name!r}, which is not a parameter here")
                nmr = self.compresses(param.shape)
                want = None if nmr is None else ((nmr[1], nmr[2]) if kind == "q" else (nmr[0], nmr[1]))
                if want is None or tuple(tensor.shape) != want:
                    raise ValueError(
                        f"PowerSGD state: {kind} for {name!r} has shape {tuple(tensor.shape)}, this "
                        f"run expects {want} (another model, rank or min_compression_rate?)"
                    )
                out[param] = tensor.to(device=param.device, dtype=param.dtype)
        self.iteration, self.q, self.errors = iteration, q, errors
        self.total_bytes = int(state.get("total_bytes", 0))
        if isinstance(state.get("generator"), torch.Tensor):
            self._generator.set_state(state["generator"])

    @staticmethod
    def merge_rank_states(states: list[dict]) -> dict:
        """One state for a different world size: the ranks' errors averaged, everything else rank 0's.

        The averaged gradient of the next step absorbs mean_w e_w (module docstring), so giving
        every new rank that mean keeps the pending correction whatever the new number of ranks.
        Q is the same on every rank already (it is all-reduced).
        """
        merged = dict(states[0])
        # a rank without an error for a parameter (none yet) counts as a zero error
        names = set().union(*(s["errors"] for s in states))
        merged["errors"] = {
            n: torch.stack([s["errors"][n] for s in states if n in s["errors"]]).sum(0) / len(states)
            for n in names
        }
        return merged

    def compresses(self, shape: torch.Size) -> tuple[int, int, int] | None:
        """(n, m, r) if a gradient of this shape is compressed, else None."""
        if len(shape) < 2 or shape.numel() == 0:
            return None
        n = shape[0]
        m = shape.numel() // n
        r = min(self.rank, n, m)
        return (n, m, r) if n * m >= self.min_compression_rate * (n + m) * r else None

    def _initial_q(self, m: int, r: int, like: torch.Tensor) -> torch.Tensor:
        return torch.randn(m, r, generator=self._generator).to(device=like.device, dtype=like.dtype)

    def _record(self, bucket, sent_bytes: int) -> None:  # bucket: a hooks.GradBucket
        buffer = bucket.buffer()
        self._step_bytes += sent_bytes
        self._step_uncompressed_bytes += buffer.numel() * buffer.element_size()
        if bucket.is_last():  # one step ends with its last bucket
            self.last_step_bytes, self.last_step_uncompressed_bytes = (
                self._step_bytes,
                self._step_uncompressed_bytes,
            )
            self.total_bytes += self._step_bytes
            self._step_bytes = self._step_uncompressed_bytes = 0
            self.iteration += 1


# `bucket` and the return value are not annotated: torch's DDP refuses a hook whose annotations are
# not the classes dist.GradBucket and Future[Tensor], and postponed annotations are strings.
def powersgd_hook(state: PowerSGDState, bucket):
    """Average the bucket's gradients with PowerSGD (see the module docstring); torch's hook contract.

    Registers with dpscale's and torch's DistributedDataParallel alike:
    `model.register_comm_hook(PowerSGDState(process_group), powersgd_hook)`.

    The two all-reduces of a bucket run to completion inside the hook. Chaining the second from the
    first one's callback would overlap more, but the callback runs on another thread, so ranks
    could then issue bucket k's Q and bucket k+1's P reductions in different orders, and
    collectives are matched by order.
    """
    buffer = bucket.buffer()
    world = dist.get_world_size(state.process_group)
    if state.iteration < state.start_iter:
        buffer.div_(world)
        dist.all_reduce(buffer, group=state.process_group)
        state._record(bucket, buffer.numel() * buffer.element_size())
        return completed(buffer)

    matrices, vectors = [], []  # (parameter, gradient as n x m, r) and flat gradients
    for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
        if (nmr := state.compresses(param.shape)) is not None:
            n, m, r = nmr
            matrices.append((param, grad.view(n, m), r))
        else:
            vectors.append(grad.view(-1))

    # message 1: every P, then the uncompressed gradients
    p_numel = sum(g.shape[0] * r for _, g, r in matrices)
    first = torch.empty(p_numel + sum(v.numel() for v in vectors), dtype=buffer.dtype, device=buffer.device)
    ps, off = [], 0
    for param, grad, r in matrices:
        if state.use_error_feedback and param in state.errors:
            grad.add_(state.errors[param])  # the buffer is overwritten by the result anyway
        q = state.q.get(param) if state.warm_start else None
        if q is None:
            q = state._initial_q(grad.shape[1], r, grad)
        p = first[off : off + grad.shape[0] * r].view(grad.shape[0], r)
        torch.matmul(grad, q, out=p)
        ps.append(p)
        off += p.numel()
    for v in vectors:
        first[off : off + v.numel()].copy_(v)
        off += v.numel()
    dist.all_reduce(first, group=state.process_group)
    off = p_numel
    for v in vectors:
        torch.div(first[off : off + v.numel()], world, out=v)
        off += v.numel()

    # message 2: every Q_w = M^T P^; the error is taken before the reduction overwrites Q_w
    second = torch.empty(
        sum(g.shape[1] * r for _, g, r in matrices), dtype=buffer.dtype, device=buffer.device
    )
    bases, qs, off = [], [], 0
    for (param, grad, r), p in zip(matrices, ps, strict=True):
        p_hat = _orthonormal(p)
        q = second[off : off + grad.shape[1] * r].view(grad.shape[1], r)
        torch.matmul(grad.T, p_hat, out=q)
        if state.use_error_feedback:
            if param not in state.errors:
                state.errors[param] = torch.empty_like(grad)
            torch.addmm(grad, p_hat, q.T, alpha=-1, out=state.errors[param])
        bases.append(p_hat)
        qs.append(q)
        off += q.numel()
    if matrices:
        dist.all_reduce(second, group=state.process_group)
        second.div_(world)
    for (param, grad, _), p_hat, q in zip(matrices, bases, qs, strict=True):
        torch.matmul(p_hat, q.T, out=grad)
        if state.warm_start:
            state.q[param] = q.clone()  # `second` is freed; the next step starts from this Q

    state._record(bucket, (first.numel() + second.numel()) * buffer.element_size())
    return completed(buffer)


def _orthonormal(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of p's columns (n x r, n >= r).

    Householder QR rather than the paper's Gram-Schmidt: its columns stay orthonormal when P is
    rank-deficient (a gradient of rank < r, or zero), where Gram-Schmidt divides by ~0. It also
    lets a zero Q recover: the basis of a zero P is still orthonormal, so the next Q_w is not zero.
    """
    if p.dtype in (torch.float32, torch.float64):
        return torch.linalg.qr(p).Q
    return torch.linalg.qr(p.float()).Q.to(p.dtype)  # no QR kernels for half types
