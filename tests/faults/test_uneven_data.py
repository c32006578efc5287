"""Scenario 11: a user's own loader yields a different number of batches on each rank.

Without a join policy the shorter rank leaves the loop while the longer one waits in its next
gradient reduction until the timeout. `iterate_in_lockstep` stops every rank after the shortest
rank's last batch, so each trains the same steps with the engine and the replicas stay equal.
"""

import pytest
import torch
from torch import nn

from dpscale.engine import DistributedDataParallel
from dpscale.lab.multirank import run_ranks
from dpscale.train.drift import fingerprint
from dpscale.train.uneven import LockstepStats, iterate_in_lockstep

pytestmark = pytest.mark.slow  # starts processes (spawned ranks or the CLI)


def train_uneven(rank, world, lengths):
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    loader = [(torch.randn(3, 4, generator=g), torch.randint(0, 2, (3,))) for _ in range(lengths[rank])]
    stats = LockstepStats()
    for x, y in iterate_in_lockstep(loader, stats=stats):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()  # reduces gradients: a collective
        opt.step()
    return stats.steps, stats.stopped_early, fingerprint(list(model.parameters())).tolist()


def two_uneven_epochs(rank, world):
    # one process pair for both cases: spawning ranks costs more than the loops
    return train_uneven(rank, world, [5, 8]), train_uneven(rank, world, [3, 0])


def test_every_rank_stops_at_the_shortest_loader_without_hanging():
    (longer, empty), (longer1, empty1) = run_ranks(two_uneven_epochs, 2, timeout_s=60)
    (steps0, early0, fp0), (steps1, early1, fp1) = longer, longer1
    assert steps0 == steps1 == 5
    assert (early0, early1) == (False, True), "only the longer rank had batches left"
    assert fp0 == fp1, "replicas must still be identical"
    # an empty loader on one rank: no step anywhere, and the other rank knows it stopped early
    assert (empty[0], empty1[0]) == (0, 0)
    assert (empty[1], empty1[1]) == (True, False)
