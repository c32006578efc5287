"""The interference probe's arithmetic (interfere.summarize) on made-up rounds; the probe itself runs in
tests/lab/predict/test_profile.py (dpscale profile --co-located 2)."""

import pytest

from dpscale.lab.predict.interfere import summarize


def _rank(free_ms: float, over_ms: float, comm_ms: float, rounds: int = 3, steps: int = 4) -> dict:
    return {
        "free": [[(free_ms, 0.0)] * steps for _ in range(rounds)],
        "overlap": [[(over_ms, comm_ms)] * steps for _ in range(rounds)],
    }


def test_slowdown_per_ms_of_overlapped_communication():
    # compute 10 ms alone, 12 ms with 4 ms of reductions beside it: 2 ms lost per 4 ms hidden
    assert summarize([_rank(10, 12, 4), _rank(9, 11, 4)]) == pytest.approx(0.5)


def test_communication_longer_than_the_step_counts_only_while_it_computed():
    # 20 ms of reductions beside a 12 ms step: only 12 ms of it overlapped compute
    assert summarize([_rank(10, 12, 20)]) == pytest.approx(2 / 12)


def test_never_negative_nor_above_one():
    assert summarize([_rank(10, 9, 4)]) == 0.0
    assert summarize([_rank(10, 30, 4)]) == 1.0
    assert summarize([_rank(10, 12, 0)]) == 0.0
