"""The shm transport's chunked sum-and-spread gives the same bits as the one-pass torch path.

The all-reduce's order of additions defines a training run's bits, so the path that sums large
parts a cache-sized chunk at a time (numpy, one torch thread) must add the same numbers in the same
order as `sum_into` (torch) does: compared bit for bit, in one process, on every rank's part.
"""

import pytest
import torch

from dpscale.comm import shm
from dpscale.comm.shm import _Region
from dpscale.comm.sum_order import sum_into


def _buffers(world: int, numel: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # magnitudes over many binades, so a different order of additions would change low bits
    scale = torch.pow(10.0, torch.randint(-6, 7, (numel,), generator=g).double())
    return [(torch.randn(numel, generator=g, dtype=torch.float64) * scale).to(dtype) for _ in range(world)]


def _reference(views: list[torch.Tensor], rank: int, world: int) -> list[torch.Tensor]:
    """What the one-pass path leaves in every rank's buffer after rank `rank` has done its part."""
    out = [v.clone() for v in views]
    region = _Region(out, rank, world)
    sum_into(region.mine, region.parts)
    for part in region.parts[1:]:
        part.copy_(region.mine)
    return out


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_sum_and_spread_is_bit_identical(world, dtype, one_thread):
    step = shm._CHUNK_BYTES // torch.empty(0, dtype=dtype).element_size()
    numel = world * (3 * step + 17)  # several chunks a part and a short last one
    for rank in range(world):
        views = _buffers(world, numel, dtype, seed=world * 10 + rank)
        expected = _reference(views, rank, world)
        region = _Region(views, rank, world)
        assert region.np_chunks is not None and len(region.np_chunks) == 4
        region.sum_and_spread()
        for got, want in zip(views, expected, strict=True):
            assert torch.equal(got, want)


def test_more_threads_keep_the_one_pass_path(monkeypatch):
    views = _buffers(2, 2 * 4 * (shm._CHUNK_BYTES // 4), torch.float32, seed=1)
    calls = []

    def counted(out, parts):
        calls.append(len(parts))
        sum_into(out, parts)

    monkeypatch.setattr(shm, "sum_into", counted)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    _Region(views, 0, 2).sum_and_spread()
    assert calls == [2]


def test_small_and_half_parts_do_not_chunk():
    small = _Region(_buffers(2, 64, torch.float32, seed=2), 0, 2)
    half = _Region(_buffers(2, 4 * shm._CHUNK_BYTES, torch.float16, seed=3), 0, 2)
    assert small.np_chunks is None and half.np_chunks is None
