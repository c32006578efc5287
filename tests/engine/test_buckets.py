"""Bucket layout: reverse registration order, caps, a small first bucket, one dtype per bucket."""

import pytest
import torch

from dpscale.engine.buckets import MB, assign_buckets, build_buckets


def floats(n: int, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype)


def test_reverse_order_and_caps():
    # 10 params of 1 KiB (256 fp32 each); first cap 2 KiB, then 3 KiB
    params = [floats(256) for _ in range(10)]
    buckets = assign_buckets(params, bucket_cap_bytes=3 * 1024, first_bucket_cap_bytes=2 * 1024)
    assert buckets == [[9, 8], [7, 6, 5], [4, 3, 2], [1, 0]]


def test_every_parameter_exactly_once_and_caps_hold():
    sizes = [5, 300, 17, 1024, 2, 2, 4096, 33, 1, 700]
    params = [floats(n) for n in sizes]
    cap, first = 4 * 1024, 512
    buckets = assign_buckets(params, cap, first)
    flat = [i for b in buckets for i in b]
    assert sorted(flat) == list(range(len(sizes)))
    assert flat == sorted(flat, reverse=True)
    for k, b in enumerate(buckets):
        nbytes = sum(sizes[i] * 4 for i in b)
        limit = first if k == 0 else cap
        assert nbytes <= limit or len(b) == 1, (k, b, nbytes)


def test_oversized_parameter_gets_its_own_bucket():
    params = [floats(10), floats(10_000), floats(10)]
    assert assign_buckets(params, 1024, 1024) == [[2], [1], [0]]


def test_dtypes_never_share_a_bucket():
    params = [floats(4), floats(4, torch.float64), floats(4), floats(4, torch.float64)]
    buckets = assign_buckets(params, MB, MB)
    for b in buckets:
        assert len({params[i].dtype for i in b}) == 1
    assert sorted(i for b in buckets for i in b) == [0, 1, 2, 3]


def test_caps_must_be_positive():
    with pytest.raises(ValueError):
        assign_buckets([floats(1)], 0, 1)


def test_views_share_the_flat_buffer():
    params = [torch.zeros(3, 4), torch.zeros(5)]
    (bucket,) = build_buckets(params, [[1, 0]])
    assert bucket.buffer.numel() == 17 and bucket.offsets == [0, 5]
    bucket.views[1].fill_(2.0)
    bucket.views[0].fill_(1.0)
    assert bucket.views[1].shape == (3, 4)
    assert bucket.buffer[:5].eq(1).all() and bucket.buffer[5:].eq(2).all()
