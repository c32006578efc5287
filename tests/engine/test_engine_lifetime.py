"""An engine dropped without close() frees its transport and shared memory, as torch DDP frees its
reducer: programs that wrap models in a loop (sweeps, tests) must not keep one bucket set each."""

import gc
import os
import weakref

import pytest
import torch
from torch import nn

from dpscale import DistributedDataParallel
from dpscale.lab.multirank import run_ranks


def _dpscale_memfds() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += "memfd:dpscale" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # the descriptor listdir itself used is gone
    return count


def drop_engines(rank, world):
    before = _dpscale_memfds()
    refs = []
    for transport in ("shm", "auto", "gloo"):
        model = DistributedDataParallel(nn.Linear(8, 4), transport=transport)
        model(torch.ones(2, 8)).sum().backward()
        refs.append((weakref.ref(model.reducer), weakref.ref(model.reducer.transport)))
        del model
    gc.collect()
    alive = [i for i, (r, t) in enumerate(refs) if r() is not None or t() is not None]
    return alive, _dpscale_memfds() - before


@pytest.mark.slow
def test_dropped_engine_frees_its_transport_and_shared_memory():
    for alive, extra_fds in run_ranks(drop_engines, 2):
        assert alive == [], "a reducer or transport outlived its engine"
        assert extra_fds == 0, f"{extra_fds} shared-memory descriptors outlived their engine"


def keep_module(rank, world):
    """The module outlives its wrapper: its gradients (views into the buckets) must stay valid."""
    module = nn.Linear(8, 4)
    model = DistributedDataParallel(module, transport="shm")
    model(torch.ones(2, 8) * (rank + 1)).sum().backward()
    del model
    gc.collect()
    torch.ones(1 << 20).add_(1)  # reuse of freed memory would show below
    return module.weight.grad.clone()


@pytest.mark.slow
def test_module_keeps_valid_gradients_after_its_engine_is_dropped():
    g0, g1 = run_ranks(keep_module, 2)
    assert torch.equal(g0, g1)
    assert torch.allclose(g0, torch.full_like(g0, 3.0))  # 2 samples x mean of 1 and 2
