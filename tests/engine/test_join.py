"""Uneven inputs under torch's Join with optimizers that are joinables too.

Rank 1 has two more batches than rank 0. torch's ZeroRedundancyOptimizer and dpscale's
ShardedOptimizer join next to the model; the final parameters must equal those of torch's DDP in
the same setting, and be the same on both ranks.
"""

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.join import Join

from dpscale import DistributedDataParallel
from dpscale.lab.multirank import run_ranks
from dpscale.optim.sharded import ShardedOptimizer, local_gradients_hook

pytestmark = pytest.mark.slow  # starts processes (spawned ranks or the CLI)


def uneven(rank, world, engine_name, optimizer_name):
    engine = DistributedDataParallel if engine_name == "dpscale" else nn.parallel.DistributedDataParallel
    torch.manual_seed(0)
    model = engine(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
    if optimizer_name == "zero":
        # imported here, in the ranks: torch.distributed.optim costs ~1 s at every collection
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    else:
        model.register_comm_hook(None, local_gradients_hook)  # the optimizer reduces
        opt = ShardedOptimizer(torch.optim.SGD, model.parameters(), lr=0.1, transport="gloo")
    gen = torch.Generator().manual_seed(rank)
    with Join([model, opt]):
        for _ in range(3 + 2 * rank):
            opt.zero_grad()
            model(torch.randn(2, 4, generator=gen)).square().sum().backward()
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("optimizer_name", ["zero", "sharded"])
def test_join_with_optimizer_joinables_matches_torch(optimizer_name):
    ours = run_ranks(uneven, 2, "dpscale", optimizer_name, timeout_s=300)
    theirs = run_ranks(uneven, 2, "torch", optimizer_name, timeout_s=300)
    for rank in range(2):
        for a, b in zip(ours[rank], theirs[rank], strict=True):
            torch.testing.assert_close(a, b)
    for a, b in zip(ours[0], ours[1], strict=True):
        torch.testing.assert_close(a, b)
