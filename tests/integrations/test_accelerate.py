"""Accelerate with dpscale's Accelerator ends where plain `accelerate.Accelerator` does.

Two ranks from the project's harness; Accelerate finds the process group already initialized.
"""

import importlib.util
import os

import pytest
import torch
from torch import nn

from dpscale.lab.multirank import run_ranks

# every test here spawns ranks: not in make test-fast. find_spec, not importorskip: importing
# accelerate costs seconds at every collection, also in the fast tier, which runs none of these tests
pytestmark = [
    pytest.mark.slow,
    pytest.mark.compat,
    pytest.mark.skipif(
        importlib.util.find_spec("accelerate") is None, reason="needs accelerate (the integrations extra)"
    ),
]


def train(rank, world, which, tmp):
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",
        OMP_NUM_THREADS="1",  # never dialled: the group exists
    )
    import accelerate

    from dpscale.integrations.accelerate import Accelerator

    cls = Accelerator if which == "dpscale" else accelerate.Accelerator
    acc = cls(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = acc.prepare(model, opt)
    engine = type(model).__module__
    gen = torch.Generator().manual_seed(10 + rank)
    synced = []
    for _ in range(6):
        x, y = torch.randn(4, 4, generator=gen), torch.randn(4, 1, generator=gen)
        with acc.accumulate(model):
            synced.append(model.require_backward_grad_sync)
            acc.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    keys = sorted(acc.get_state_dict(model))
    unwrapped = type(acc.unwrap_model(model)).__name__
    acc.save_model(model, f"{tmp}/{which}")
    refused = None
    if which == "dpscale":
        try:
            acc.prepare_model(model)
        except ValueError as e:
            refused = str(e)
    return [p.detach().clone() for p in model.parameters()], engine, synced, keys, unwrapped, refused


def test_dpscale_accelerator_matches_accelerate(tmp_path):
    ours = run_ranks(train, 2, "dpscale", str(tmp_path), timeout_s=300)
    theirs = run_ranks(train, 2, "torch", str(tmp_path), timeout_s=300)
    assert ours[0][1] == "dpscale.engine.ddp" and theirs[0][1] == "torch.nn.parallel.distributed"
    assert ours[0][2] == theirs[0][2] == [False, True] * 3  # accumulate() honours no_sync
    assert ours[0][3] == theirs[0][3] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert ours[0][4] == "Sequential"
    assert "already wrapped" in ours[0][5] and "\n" not in ours[0][5]
    for rank in range(2):
        for a, b in zip(ours[rank][0], theirs[rank][0], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "dpscale" / "model.safetensors")
    assert sorted(saved) == ours[0][3]
