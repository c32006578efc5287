"""Replica fingerprints: exact under any summation order, sensitive to any single change."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dpscale.train.drift import check_replicas, checked_tensors, fingerprint


def test_fingerprint_does_not_depend_on_the_thread_count():
    t = torch.randn(3_000_001)  # odd, and large enough to be summed in parallel
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fingerprint([t])
        torch.set_num_threads(max(2, old))
        many = fingerprint([t])
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, many)


@pytest.mark.parametrize("index", [0, 1, 1000, -1])
def test_any_single_changed_element_changes_the_fingerprint(index):
    t = torch.randn(1001)
    before = fingerprint([t])
    t[index] = torch.nextafter(t[index], torch.tensor(float("inf")))  # the smallest possible change
    assert not torch.equal(fingerprint([t]), before)


def test_every_dtype_and_layout_gets_a_fingerprint():
    base = torch.randn(9, 7)
    tensors = [
        base,
        base.t(),  # not contiguous
        base.view(-1)[1:],  # storage offset of 4 bytes: not 8-byte aligned
        base.half(),
        torch.arange(5),
        torch.tensor([True, False, True]),
        torch.zeros(0),
    ]
    fp = fingerprint(tensors)
    assert fp.shape == (7,) and fp[-1] == 0
    assert fp[1] == fp[0], "the same values in another layout are the same tensor"


def test_batchnorm_running_statistics_are_not_compared():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    names = [n for n, _ in checked_tensors(model)]
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias", "1.num_batches_tracked"]


def test_one_rank_never_drifts():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        check_replicas(nn.Linear(3, 2), step=1)
    finally:
        dist.destroy_process_group()
