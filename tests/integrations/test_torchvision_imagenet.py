"""A torchvision user's script on dpscale's engine: pytorch/examples' imagenet/main.py with --dummy.

The loop is main.py's, cut to what runs in seconds on CPU: `models.resnet18()`, FakeData with
ToTensor, a DistributedSampler with set_epoch, CrossEntropyLoss, SGD with momentum and weight
decay, `model.train()`, zero_grad/backward/step. Sizes shrink (32x32 images, 10 classes, batch 4
per rank, 4 steps) so the test stays short. Two ranks run it on torch's DDP and on dpscale's from
the same seed; the losses and the final weights must agree. torchvision is in the compat venv
(make test-compat), not the main one.
"""

import pytest
import torch

from dpscale.lab.multirank import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.compat]

SEED = 0
STEPS_PER_EPOCH = 4
BATCH_PER_RANK = 4


def imagenet_dummy(rank, world, engine):
    torchvision = pytest.importorskip("torchvision")
    from torch import nn
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from dpscale import DistributedDataParallel as DPScaleDDP

    torch.manual_seed(SEED)  # main.py --seed: the same initial weights on every rank and engine
    model = torchvision.models.resnet18(num_classes=10)
    ddp = DPScaleDDP(model) if engine == "dpscale" else nn.parallel.DistributedDataParallel(model)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(ddp.parameters(), 0.1, momentum=0.9, weight_decay=1e-4)
    # main.py --dummy: FakeData(1281167, (3, 224, 224), 1000, ToTensor()); its images are drawn
    # from the sample's index, so every rank and engine sees the same data
    data = torchvision.datasets.FakeData(
        STEPS_PER_EPOCH * BATCH_PER_RANK * world, (3, 32, 32), 10, torchvision.transforms.ToTensor()
    )
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=BATCH_PER_RANK, shuffle=False, sampler=sampler)
    losses = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        ddp.train()
        for images, target in loader:
            loss = criterion(ddp(images), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()], type(ddp).__module__


def test_resnet18_on_fakedata_is_torch_ddps_on_two_ranks():
    pytest.importorskip("torchvision", reason="torchvision is in the compat venv only (make test-compat)")
    ours = run_ranks(imagenet_dummy, 2, "dpscale", timeout_s=240)
    theirs = run_ranks(imagenet_dummy, 2, "torch", timeout_s=240)
    assert ours[0][2] == "dpscale.engine.ddp" and theirs[0][2] == "torch.nn.parallel.distributed"
    for rank in range(2):
        assert len(ours[rank][0]) == 2 * STEPS_PER_EPOCH
        # two ranks: each gradient element is a + b in either engine, so the runs agree bit for bit;
        # the losses differ between ranks (each rank its own samples) and change as the model trains
        assert ours[rank][0] == theirs[rank][0]
        for a, b in zip(ours[rank][1], theirs[rank][1], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert ours[0][0] != ours[1][0]
    assert ours[0][0][0] != ours[0][0][-1]
