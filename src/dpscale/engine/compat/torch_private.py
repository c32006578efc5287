"""Every private torch attribute the engine uses, each checked against the running torch.

A leading-underscore name in torch is no promise: a release may move or drop it. Keeping all of
the engine's uses here makes a new torch release a one-file change. Each accessor looks its
attribute up once, on first use; where it is missing it either falls back to torch's public
behaviour (said at the accessor) or raises `TorchPrivateError`, one line naming the torch version
and the feature that needs it. The same holds for comm/ in `dpscale.comm.torch_private` (comm sits
below the engine and does not import it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


class TorchPrivateError(RuntimeError):
    """A private torch attribute that a feature needs is missing from the running torch."""


def lookup(owner: object, path: str, feature: str, *, expect: Callable[[Any], bool] = callable) -> Any:
    """`owner.<path>` (dotted), checked with `expect`; `TorchPrivateError` naming the torch
    version and `feature` when it is missing or not what `expect` accepts."""
    value = owner
    for part in path.split("."):
        value = getattr(value, part, None)
        if value is None:
            break
    if value is None or not expect(value):
        raise TorchPrivateError(
            f"torch {torch.__version__} has no usable {path} ({feature} needs it); "
            "please report this torch version to dpscale"
        )
    return value


@functools.cache
def _queue_callback() -> Callable[[Callable[[], None]], None]:
    engine = lookup(
        torch.autograd.Variable,
        "_execution_engine",
        "running the reduction's end after backward",
        expect=lambda e: callable(getattr(e, "queue_callback", None)),
    )
    return engine.queue_callback


def queue_autograd_callback(callback: Callable[[], None]) -> None:
    """Run `callback` on the autograd engine once the current backward is done (no public
    equivalent: torch's own DDP uses the same call)."""
    _queue_callback()(callback)


def join_enabled(joinable: object) -> bool:
    """Whether a `Join` context has enabled `joinable` (torch's Joinable keeps it in the private
    `_join_config`, set by `Joinable.__init__` and by `Join`; no public accessor)."""
    config = getattr(joinable, "_join_config", None)
    enable = getattr(config, "enable", None)
    if not isinstance(enable, bool):
        raise TorchPrivateError(
            f"torch {torch.__version__} has no usable Joinable._join_config.enable (uneven inputs "
            "under torch.distributed.algorithms.join.Join need it); please report this torch "
            "version to dpscale"
        )
    return enable


def _default_store() -> Callable[[], Any]:
    return lookup(
        torch.distributed.distributed_c10d, "_get_default_store", "naming the silent ranks of a hang"
    )


def default_store() -> Any:
    """The default group's store (no public accessor: torch's own elastic agent passes the store
    around instead). Raises when there is no default group. Looked up at each call: it runs only
    to explain a hang."""
    return _default_store()()


@functools.cache
def _storage_use_count() -> Callable[[int], int] | None:
    try:
        return lookup(torch._C, "_storage_Use_Count", "reusing the small-gradient pool")
    except TorchPrivateError:
        return None


def storage_use_count(tensor: torch.Tensor) -> int | None:
    """How many tensors share `tensor`'s storage; None where torch cannot tell (the caller then
    treats the storage as shared: public behaviour, a fresh buffer each step)."""
    count = _storage_use_count()
    return None if count is None else count(tensor.untyped_storage()._cdata)


@functools.cache
def _foreach_copy() -> Callable[[list[torch.Tensor], list[torch.Tensor]], None] | None:
    return getattr(torch, "_foreach_copy_", None)


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """`dst[k].copy_(src[k])` for every k, in one fused call where torch has one (the fallback,
    one public copy_ per tensor, gives the same values)."""
    fused = _foreach_copy()
    if fused is not None:
        fused(dst, src)
    else:
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)


@functools.cache
def _profiler_enabled() -> Callable[[], bool] | None:
    try:
        return lookup(torch._C._autograd, "_profiler_enabled", "dpscale's ranges in torch.profiler")
    except TorchPrivateError:
        return None


def profiler_enabled() -> bool:
    """Whether a torch.profiler (or torch.autograd.profiler) session is recording on this thread's
    process. torch has no public query; where the private one is gone the answer is False: the
    engine then adds no ranges to the profile (public behaviour, nothing else changes)."""
    enabled = _profiler_enabled()
    return enabled is not None and bool(enabled())
