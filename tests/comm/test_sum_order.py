"""The order in which the shm transport adds the ranks' copies, as both of its paths read it."""

import pytest

from dpscale.comm.base import chunk_bounds
from dpscale.comm.sum_order import part_order, ranges_in_order


def test_a_part_starts_with_its_own_rank_then_the_others_in_rank_order():
    assert part_order(0, 3) == [0, 1, 2]
    assert part_order(2, 4) == [2, 0, 1, 3]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_ranges_cover_the_tensor_each_element_in_its_parts_order(world):
    for numel in range(13):
        ranges = ranges_in_order(numel, world)
        covered = [i for lo, hi, _ in ranges for i in range(lo, hi)]
        assert covered == list(range(numel))  # in order, once each, nothing empty
        for lo, hi, order in ranges:
            for i in range(lo, hi):
                part = next(
                    p
                    for p in range(world)
                    if chunk_bounds(numel, world, p)[0] <= i < chunk_bounds(numel, world, p)[1]
                )
                want = part_order(part, world)
                # parts 0 and 1 share a range: their orders differ only in the first two terms
                assert order == want or (part == 1 and order[:2] == want[1::-1] and order[2:] == want[2:])


def test_parts_0_and_1_are_one_range():
    assert ranges_in_order(10, 4) == [(0, 6, [0, 1, 2, 3]), (6, 8, [2, 0, 1, 3]), (8, 10, [3, 0, 1, 2])]
    assert ranges_in_order(1, 4) == [(0, 1, [0, 1, 2, 3])]
    assert ranges_in_order(0, 2) == []
