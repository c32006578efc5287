"""The one factory: dpscale's and torch's DDP built alike, so the benches compare like with like."""

import pytest
import torch
from torch import nn

from dpscale import DistributedDataParallel
from dpscale.engine.factory import wrap
from dpscale.lab.multirank import run_ranks


def built(rank, world):
    out = {}
    for engine in ("dpscale", "dpscale-gloo", "torch"):
        model = wrap(nn.Linear(4, 2), engine)
        model(torch.ones(3, 4)).sum().backward()
        grad = model.module.weight.grad
        # with bucket views, .grad is a view into the engine's flat bucket (no copy back)
        out[engine] = (model.gradient_as_bucket_view, grad._base is not None or not grad.is_contiguous())
        if isinstance(model, DistributedDataParallel):
            model.close()
    return out


@pytest.mark.slow
def test_both_engines_get_gradients_as_bucket_views():
    for result in run_ranks(built, 2):
        assert result == {e: (True, True) for e in ("dpscale", "dpscale-gloo", "torch")}
