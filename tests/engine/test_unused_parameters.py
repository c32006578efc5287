"""find_unused_parameters with no_sync: which parameters are used depends on the rank and the step.

A parameter that one rank used only in a no_sync micro-step carries a local gradient into the
synced step; every rank must then get the averaged gradient, or the replicas drift apart silently.
"""

import pytest
import torch
from torch import nn

from dpscale import DistributedDataParallel
from dpscale.lab.multirank import run_ranks

pytestmark = pytest.mark.slow  # starts processes (spawned ranks or the CLI)


class Switchboard(nn.Module):
    """Branch `route` is one of four linear layers; the caller picks it per rank and step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.branches = nn.ModuleList(nn.Linear(3, 3) for _ in range(4))

    def forward(self, x, route):
        return self.branches[route](x)


# (rank, micro-step) -> branch: rank 0 uses 0 then 1, rank 1 uses 2 then 3; branch 3 is also
# used by rank 0 in the second window's no_sync step only
ROUTES = {0: [[0, 1], [3, 1]], 1: [[2, 3], [2, 2]]}


def train(rank, world, engine_name):
    engine = DistributedDataParallel if engine_name == "dpscale" else nn.parallel.DistributedDataParallel
    model = engine(Switchboard(), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(10 + rank)
    grads = []
    for window in ROUTES[rank]:
        opt.zero_grad(set_to_none=True)
        for k, route in enumerate(window):
            x = torch.randn(2, 3, generator=gen)
            if k < len(window) - 1:
                with model.no_sync():
                    model(x, route).square().sum().backward()
            else:
                model(x, route).square().sum().backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads, [p.detach().clone() for p in model.parameters()]


def test_parameters_used_only_in_no_sync_steps_are_reduced_on_every_rank():
    ours = run_ranks(train, 2, "dpscale")
    theirs = run_ranks(train, 2, "torch")
    for rank in range(2):
        grads, params = ours[rank]
        ref_grads, ref_params = theirs[rank]
        for window, (g, ref) in enumerate(zip(grads, ref_grads, strict=True)):
            for k, (a, b) in enumerate(zip(g, ref, strict=True)):
                assert (a is None) == (b is None), f"rank {rank} window {window} param {k}"
                if a is not None:
                    torch.testing.assert_close(a, b)
        for a, b in zip(params, ref_params, strict=True):
            torch.testing.assert_close(a, b)
    # and the replicas agree
    for a, b in zip(ours[0][1], ours[1][1], strict=True):
        torch.testing.assert_close(a, b)
