"""The bucket timeline: a reduction starts when its bucket is ready and the link is free."""

import pytest

from dpscale.lab.predict.timeline import ReadyBucket, simulate


def const(ms: float):
    return lambda nbytes: ms


def test_early_bucket_is_hidden_entirely():
    t = simulate([ReadyBucket(0, 10, 10.0)], 100.0, const(5.0))
    assert (t.spans[0].start_ms, t.spans[0].end_ms) == (10.0, 15.0)
    assert t.exposed_comm_ms == 0 and t.comm_ms == 5.0 and t.hidden_comm_ms == 5.0


def test_a_busy_link_queues_the_next_bucket():
    t = simulate([ReadyBucket(0, 1, 50.0), ReadyBucket(1, 1, 60.0)], 100.0, const(30.0))
    assert [(s.start_ms, s.end_ms) for s in t.spans] == [(50.0, 80.0), (80.0, 110.0)]
    assert t.exposed_comm_ms == pytest.approx(10.0)
    assert t.end_ms == pytest.approx(110.0)


def test_last_bucket_at_the_end_of_backward_is_exposed_whole():
    t = simulate([ReadyBucket(0, 1, 20.0), ReadyBucket(1, 1, 100.0)], 100.0, const(7.0))
    assert t.exposed_comm_ms == pytest.approx(7.0)


def test_without_overlap_everything_waits_for_the_end_of_backward():
    buckets = [ReadyBucket(i, 1, r) for i, r in enumerate((10.0, 40.0, 90.0))]
    t = simulate(buckets, 100.0, const(4.0), overlap=False)
    assert t.spans[0].start_ms == 100.0
    assert t.exposed_comm_ms == pytest.approx(12.0) == pytest.approx(t.comm_ms)


def test_cost_depends_on_bucket_bytes():
    t = simulate([ReadyBucket(0, 1000, 0.0), ReadyBucket(1, 3000, 1.0)], 2.0, lambda n: n / 1000)
    assert [s.duration_ms for s in t.spans] == [1.0, 3.0]
    assert t.exposed_comm_ms == pytest.approx(2.0)  # 0-1, then 1-4: ends 2 ms after backward


def test_a_bucket_outside_backward_is_refused():
    with pytest.raises(ValueError, match="outside backward"):
        simulate([ReadyBucket(0, 1, 120.0)], 100.0, const(1.0))
