"""Counting host syncs on CPU: the tensor calls that would stop the host for the device on CUDA.

On a GPU, reading a device tensor's value (`item`, `tolist`, `float()`, `bool()`, `int()`) waits
for every kernel queued before it, and making a tensor from host data (`new_tensor`,
`torch.tensor`) copies it host-to-device. On CPU none of them waits for anything, so the tests
count the calls instead: each is a sync the same code makes on a device. Calls inside
`torch.optim` are not counted: the optimizers' step counters live on the host on every device
(unless capturable), so their reads never wait for the device.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

import dpscale

# dpscale's own frames: their files' paths start so (as the package was imported, like co_filename)
_PACKAGE = os.path.dirname(dpscale.__file__) + os.sep
_READS = ("item", "tolist", "__float__", "__bool__", "__int__", "new_tensor")


@dataclass
class SyncCount:
    """What was counted: `total`, and per call site (the innermost dpscale frame, file:line)."""

    sites: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def reset(self) -> None:
        self.sites.clear()


def _site() -> str | None:
    """Where the call came from (None: torch.optim's own host-side counters)."""
    frame = sys._getframe(2)
    first = None
    while frame is not None:
        name = frame.f_code.co_filename
        if "torch/optim/" in name and first is None:
            return None
        if name.startswith(_PACKAGE):  # not "/dpscale/" in name: a checkout may be named dpscale
            return f"{name[len(_PACKAGE) :]}:{frame.f_lineno}"
        first = first or name
        frame = frame.f_back
    return first


@contextmanager
def count_syncs() -> Iterator[SyncCount]:
    """Count the host syncs (see the module's docstring) made inside the block."""
    count = SyncCount()
    originals = {name: getattr(torch.Tensor, name) for name in _READS}
    original_tensor = torch.tensor
    depth = [0]  # a counted call that calls another (tolist -> item) counts once

    def wrap(fn):
        def counted(*args, **kwargs):
            if depth[0] == 0:
                site = _site()
                if site is not None:
                    count.sites[site] += 1
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    try:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, wrap(fn))
        torch.tensor = wrap(original_tensor)
        yield count
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
        torch.tensor = original_tensor
