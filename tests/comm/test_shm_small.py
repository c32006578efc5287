"""The one-round all-reduce of small tensors gives, on every rank, the bits of the in-place path.

The order of additions defines a training run's bits, and which path a tensor takes depends on
its size, so both must add the same numbers in the same order. Checked in one process (no rank
started): every "rank" has its mailboxes in one shared mapping, as the transport lays them out,
and the in-place path is run on copies, one rank's part after the other, as the ranks would.
"""

import mmap

import pytest
import torch

from dpscale.comm import shm_small
from dpscale.comm.shm import _Region
from dpscale.comm.shm_small import LL_MAX_BYTES, SMALL_MAX_BYTES, Mailboxes

OFFSET = 4096  # as the transport: the control line's page first
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _data(world: int, numel: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # magnitudes over many binades, so a different order of additions would change low bits
    scale = torch.pow(10.0, torch.randint(-4, 5, (numel,), generator=g).double())
    return [(torch.randn(numel, generator=g, dtype=torch.float64) * scale).to(dtype) for _ in range(world)]


def _in_place(xs: list[torch.Tensor]) -> torch.Tensor:
    """What the in-place path (shm._Region) leaves in every rank's buffer."""
    views = [x.clone() for x in xs]
    for rank in range(len(xs)):
        _Region(views, rank, len(xs)).sum_and_spread()
    for v in views[1:]:
        assert torch.equal(v.view(torch.uint8), views[0].view(torch.uint8))
    return views[0]


def _ranks(world: int, capacity: int = SMALL_MAX_BYTES) -> list[Mailboxes]:
    maps = [mmap.mmap(-1, OFFSET + 2 * capacity) for _ in range(world)]
    return [Mailboxes(maps, OFFSET, capacity, r) for r in range(world)]


def _one_round(boxes: list[Mailboxes], xs: list[torch.Tensor], slot: int) -> list[torch.Tensor]:
    """Every rank posts, then every rank sums: the one-round path's result on each rank."""
    outs = [x.clone() for x in xs]
    calls = [b.bind(out) for b, out in zip(boxes, outs, strict=True)]
    for call in calls:
        call.post(slot)
    for call in calls:
        call.sum(slot)
    return outs


def _sizes(dtype: torch.dtype) -> list[int]:
    item = torch.empty(0, dtype=dtype).element_size()
    most = SMALL_MAX_BYTES // item
    # one element, a few, sizes no world size divides, around the flagged words' limit, 4 KiB, and
    # the largest the path takes
    flagged = LL_MAX_BYTES // item
    return [1, 3, 17, flagged, flagged + 1, 1001, 4096 // item, most - 1, most]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_round_equals_the_in_place_path_bit_for_bit(world, dtype):
    boxes = _ranks(world)
    for i, numel in enumerate(_sizes(dtype)):
        xs = _data(world, numel, dtype, seed=world * 100 + i)
        want = _in_place(xs).view(torch.uint8)
        for slot in (0, 1):
            for rank, got in enumerate(_one_round(boxes, xs, slot)):
                assert torch.equal(got.view(torch.uint8), want), (numel, slot, rank)


def test_the_order_is_each_parts_own_rank_first():
    # at 3 ranks the order matters: part 2 is (x2 + x0) + x1, where 1 is lost against 1e8
    xs = [torch.full((6,), v) for v in (1e8, -1e8, 1.0)]
    expected = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    assert torch.equal(_in_place(xs), expected)
    for got in _one_round(_ranks(3), xs, 0):
        assert torch.equal(got, expected)


def test_a_tensor_is_only_written_by_its_own_sum():
    # each rank reads only the mailboxes, so a rank that has summed cannot disturb a peer's sum
    boxes = _ranks(2)
    xs = _data(2, 100, torch.float32, seed=7)
    outs = [x.clone() for x in xs]
    calls = [b.bind(out) for b, out in zip(boxes, outs, strict=True)]
    for call in calls:
        call.post(1)
    calls[0].sum(1)
    assert torch.equal(outs[1], xs[1])  # rank 1 has not summed yet: its tensor is untouched
    calls[1].sum(1)
    assert torch.equal(outs[0], outs[1])


def test_what_fits():
    boxes = _ranks(2)[0]
    item = SMALL_MAX_BYTES // 4
    assert boxes.fits(torch.zeros(item)) and not boxes.fits(torch.zeros(item + 1))
    assert not boxes.fits(torch.zeros(4, 4).t())  # not contiguous
    assert not _ranks(1)[0].fits(torch.zeros(4))  # one rank: nothing to reduce
    assert not _ranks(2, capacity=0)[0].fits(torch.zeros(1))  # the path turned off


def test_operand_lists_are_shared_by_size_and_bounded(monkeypatch):
    monkeypatch.setattr(shm_small, "_MAX_SHAPES", 2)
    boxes = _ranks(2)[0]
    boxes.bind(torch.zeros(8))
    boxes.bind(torch.zeros(8))
    assert len(boxes._terms) == 1
    boxes.bind(torch.zeros(9))
    boxes.bind(torch.zeros(10))
    assert len(boxes._terms) == 1  # cleared at the bound, then the newest added
