"""dpscale's engine where torch DDP users reach past plain steps: each behaviour compared with torch's.

Scenarios run in the same two ranks on both engines (one spawn per engine for all of them), and
the results must match: create_graph, sparse gradients with and without a comm hook, a static
graph with reentrant checkpointing, uneven inputs under Join, and a pickled model.
"""

import io
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.checkpoint import checkpoint

from dpscale import DistributedDataParallel
from dpscale.lab.multirank import run_ranks

# slow: starts processes (spawned ranks or the CLI); compat: also run on a second torch release
pytestmark = [pytest.mark.slow, pytest.mark.compat]


def engine_class(name):
    return DistributedDataParallel if name == "dpscale" else nn.parallel.DistributedDataParallel


def grads(model):
    return [None if p.grad is None else p.grad.detach().to_dense().clone() for p in model.parameters()]


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


class Square(nn.Module):
    def __init__(self, rank):
        super().__init__()
        self.p = nn.Parameter(torch.tensor(1.0))
        self.rank = rank

    def forward(self):
        return self.p.pow(2) * (self.rank + 1)


class Bags(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 3, sparse=True)
        self.bag = nn.EmbeddingBag(10, 3, sparse=True, mode="sum")
        self.out = nn.Linear(3, 1)

    def forward(self, ids):
        return self.out(self.emb(ids).sum(1) + self.bag(ids))


class Checkpointed(nn.Module):
    """Reentrant checkpointing runs a second backward inside the first: gradients arrive twice."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x):
        h = checkpoint(self.a, x, use_reentrant=True)
        h = checkpoint(self.a, h, use_reentrant=True)  # `a` used twice: two gradient arrivals
        return self.b(h)


def scenarios(rank, world, engine_name):
    DDP = engine_class(engine_name)
    out = {}
    gen = torch.Generator().manual_seed(rank)

    # create_graph=True: torch warns and reduces (torch's own test's model; on a Linear layer
    # torch's engine raises, dpscale's does not)
    model = DDP(Square(rank))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for _ in range(3):
            model().backward(create_graph=True)
    out["create_graph"] = grads(model)

    # sparse gradients, plain and through torch's allreduce hook
    for hooked in (False, True):
        model = DDP(Bags())
        if hooked:
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randint(0, 10, (4, 2), generator=gen)).sum().backward()
            opt.step()
        out[f"sparse hooked={hooked}"] = grads(model) + [p.detach().clone() for p in model.parameters()]

    # static graph: reentrant checkpointing, several steps
    model = DDP(Checkpointed(), static_graph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(2, 4, generator=gen).requires_grad_()).sum().backward()
        opt.step()
    out["static graph"] = grads(model) + [p.detach().clone() for p in model.parameters()]

    # uneven inputs: rank 1 has two more batches; both divide conventions
    for divide in (True, False):
        model = DDP(mlp())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.join(divide_by_initial_world_size=divide):
            for _ in range(3 + 2 * rank):
                opt.zero_grad()
                model(torch.randn(2, 4, generator=gen)).sum().backward()
                opt.step()
        out[f"join divide={divide}"] = [p.detach().clone() for p in model.parameters()]

    # a pickled model trains on after loading (the default group; engine state rebuilt)
    model = DDP(mlp())
    model(torch.randn(2, 4, generator=gen)).sum().backward()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    loaded.zero_grad()
    loaded(torch.randn(2, 4, generator=gen)).sum().backward()
    out["pickled"] = grads(loaded)
    out["isinstance"] = isinstance(model, nn.parallel.DistributedDataParallel)
    return out


@pytest.fixture(scope="module")
def both():
    return run_ranks(scenarios, 2, "dpscale", timeout_s=300), run_ranks(scenarios, 2, "torch", timeout_s=300)


@pytest.mark.parametrize(
    "name",
    [
        "create_graph",
        "sparse hooked=False",
        "sparse hooked=True",
        "static graph",
        "join divide=True",
        "join divide=False",
        "pickled",
        "isinstance",
    ],
)
def test_matches_torch_ddp(both, name):
    ours, theirs = both
    for rank in range(2):
        a, b = ours[rank][name], theirs[rank][name]
        if isinstance(b, bool):
            assert a == b
            continue
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert (x is None) == (y is None)
            if x is not None:
                torch.testing.assert_close(x, y)


def test_replicas_agree_after_uneven_inputs(both):
    ours, _ = both
    for key in ("join divide=True", "join divide=False"):
        for x, y in zip(ours[0][key], ours[1][key], strict=True):
            torch.testing.assert_close(x, y)
