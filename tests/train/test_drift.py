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


def _reference_fingerprint(t: torch.Tensor) -> int:
    # the definition, in Python integers: bytes as little-endian int64 words plus the tail's bytes
    raw = t.detach().reshape(-1).view(torch.uint8).tolist()
    n = len(raw) // 8 * 8
    words = [int.from_bytes(bytes(raw[i : i + 8]), "little", signed=True) for i in range(0, n, 8)]
    return (sum(words) + sum(raw[n:]) + 2**63) % 2**64 - 2**63


def test_the_fingerprint_is_its_definition_computed_without_leaving_the_device():
    tensors = [
        torch.randn(37),
        torch.randn(5, 3).double(),
        torch.arange(11, dtype=torch.int16),
        torch.ones(0),
    ]
    assert fingerprint(tensors).tolist() == [_reference_fingerprint(t) for t in tensors]


def test_the_drift_check_gathers_one_tensor_and_reads_the_host_once(monkeypatch):
    # on a GPU each read of a device value stalls the host: the fingerprints of every tensor go in
    # one all-gather, and the gathered table comes to the host once (here: one .cpu(), and no
    # tensor read as a Python number before it)
    from dpscale.train import drift

    events = []
    gathers = []
    real_gather = drift.all_gather_into
    monkeypatch.setattr(
        drift, "all_gather_into", lambda out, t, g: (gathers.append(t.shape), real_gather(out, t, g))
    )
    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor,
            name,
            lambda self, *a, _n=name, _r=real, **k: (events.append(_n), _r(self, *a, **k))[1],
        )
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2), nn.BatchNorm1d(2))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        check_replicas(model, step=100)
    finally:
        dist.destroy_process_group()
    assert gathers == [torch.Size([7])]  # one tensor: 3 weights, 3 biases, num_batches_tracked
    assert events[0] == "cpu" and events.count("cpu") == 1, events
