"""Communication hooks: a function from a gradient bucket to a Future of the reduced flat tensor.

The contract is torch DDP's, so hooks written for torch (`torch.distributed.algorithms.
ddp_comm_hooks`) run here unchanged and ours run there: `hook(state, bucket)` receives a
`GradBucket` whose `buffer()` holds this rank's *summed, undivided* gradients and returns a
`torch.futures.Future` whose value is the tensor of *averaged* gradients, shaped like the buffer.
`state` is whatever was passed to `register_comm_hook`; for the built-ins it is the process group
(None for the default group). `compression_hook(name, group)` picks a built-in by the name
`TrainConfig.engine.compression` and `dpscale bench convergence --compression` use (PowerSGD's own
algorithm lives in powersgd.py).

Each built-in divides by the world size *before* the reduction: the sum of W already-averaged
values cannot overflow a low-precision type when the individual values do not, and it keeps
the fp16/bf16 rounding error relative to the final average rather than to a W-times larger sum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dpscale.engine.powersgd import PowerSGDState, powersgd_hook
from dpscale.errors import ConfigError


class GradBucket:
    """What a hook sees of a bucket; method names follow `torch.distributed.GradBucket`."""

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        offsets: list[int],
        is_last: bool,
    ):
        self._index = index
        self._buffer = buffer
        self._params = list(params)
        self._grads = list(grads)
        self._offsets = offsets
        self._is_last = is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def offsets(self) -> list[int]:
        return self._offsets

    def is_last(self) -> bool:
        return self._is_last


CommHook = Callable[[Any, GradBucket], torch.futures.Future]


def _group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


# The built-ins carry no annotations on `bucket` and the return value: torch DDP's
# register_comm_hook checks them against its own GradBucket and Future types and refuses others,
# and the hooks must register on both engines.
def allreduce_hook(process_group, bucket):
    """Plain average: divide in place, all-reduce the sum asynchronously."""
    tensor = bucket.buffer()
    tensor.div_(_group_size(process_group))
    return (
        dist.all_reduce(tensor, group=process_group, async_op=True)
        .get_future()
        .then(lambda fut: fut.value()[0])
    )


def _compress_hook(dtype: torch.dtype) -> CommHook:
    def hook(process_group, bucket):
        buffer = bucket.buffer()
        compressed = torch.empty_like(buffer, dtype=dtype)
        torch.div(buffer, _group_size(process_group), out=compressed)  # cast and divide in one pass
        fut = dist.all_reduce(compressed, group=process_group, async_op=True).get_future()

        def decompress(f: torch.futures.Future) -> torch.Tensor:
            buffer.copy_(f.value()[0])  # copy_ casts back to the buffer's dtype
            return buffer

        return fut.then(decompress)

    hook.__name__ = f"{str(dtype).removeprefix('torch.')}_compress_hook"
    hook.__doc__ = (
        f"Average in {dtype}: half the bytes on the wire; sums are rounded to {dtype} at each "
        "reduction step, so expect a relative error of a few units of that type's precision."
    )
    return hook


fp16_compress_hook = _compress_hook(torch.float16)
bf16_compress_hook = _compress_hook(torch.bfloat16)


# -- choosing a hook by name (TrainConfig.engine.compression, `dpscale bench convergence --compression`) --

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")


def compression_hook(name: str, process_group: dist.ProcessGroup | None) -> tuple[object, CommHook] | None:
    """(state, hook) to pass to `register_comm_hook` for compression `name`; None for "none"."""
    if name not in COMPRESSIONS:
        raise ConfigError(f"compression: unknown {name!r}; choose one of {', '.join(COMPRESSIONS)}")
    if name == "fp16":
        return process_group, fp16_compress_hook
    if name == "bf16":
        return process_group, bf16_compress_hook
    if name == "powersgd":
        return PowerSGDState(process_group), powersgd_hook
    return None


def checked_future(fut: object) -> torch.Future:
    """A hook's result, checked as torch's reducer checks it (same message)."""
    # torch.Future (the C++ future's public name): a Work's get_future() gives one,
    # torch.futures.Future derives from it
    if not isinstance(fut, torch.Future):
        got = type(fut).__name__
        raise RuntimeError(f"callback must return a torch.futures.Future object, but got {got}")
    return fut
