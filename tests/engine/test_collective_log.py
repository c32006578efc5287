"""The collective log: the ring, how records read, which errors count as communication failures."""

import threading
import time

import pytest
import torch
import torch.distributed as dist

from dpscale.comm import PeerTimeoutError
from dpscale.engine import collective_log
from dpscale.engine.collective_log import (
    CollectiveError,
    CollectiveLog,
    explain_failures,
    is_comm_failure,
)
from support.timing import cpu_baseline_s


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ring_keeps_the_newest_records_oldest_first():
    log = CollectiveLog(capacity=3)
    for i in range(5):
        log.record("all_reduce", f"bucket {i}", torch.zeros(i + 1), bucket=i)
    assert [r.seq for r in log.records()] == [3, 4, 5]
    assert str(log.records()[-1]) == "#5 all_reduce of bucket 4 (5 x float32)"
    assert (
        log.describe(last=2)
        == "#4 all_reduce of bucket 3 (4 x float32); #5 all_reduce of bucket 4 (5 x float32)"
    )


def test_object_collectives_are_recorded_without_a_size():
    log = CollectiveLog()
    assert (
        str(log.record("all_gather_object", "RNG states"))
        == "#1 all_gather_object of RNG states (python objects)"
    )
    assert CollectiveLog().describe() == "nothing yet"


@pytest.mark.parametrize(
    "exc,expected",
    [
        (
            RuntimeError(
                "[gloo/unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation to complete"
            ),
            True,
        ),
        (RuntimeError("[gloo/pair.cc:534] Connection closed by peer [127.0.0.1]:4021"), True),
        (PeerTimeoutError("shm transport: rank 0 waited 2 s for rank 1 at collective #5"), True),
        (RuntimeError("parameters got no gradient in this backward pass: '0.weight'"), False),
        (ValueError("timed out"), False),  # a user error, whatever it says
        (CollectiveError("timed out"), False),  # already explained: not wrapped twice
    ],
)
def test_which_errors_are_communication_failures(exc, expected):
    assert is_comm_failure(exc) is expected


def test_other_errors_pass_through_unchanged():
    with pytest.raises(ValueError, match="^plain$"), explain_failures(CollectiveLog(), wait_s=0.1):
        raise ValueError("plain")


def test_a_timeout_is_explained_with_this_ranks_ring(world_of_one):
    log = CollectiveLog()
    log.record("all_reduce", "step flags", torch.zeros(2, dtype=torch.float64))
    with pytest.raises(CollectiveError) as err, explain_failures(log, wait_s=0.5):
        raise RuntimeError("Timed out waiting 2000ms for recv operation to complete")
    text = str(err.value)
    assert text.startswith("rank 0: a collective failed (RuntimeError: Timed out waiting 2000ms")
    assert "did not report" not in text  # the only rank answered
    assert text.endswith("this rank last issued (oldest first): #1 all_reduce of step flags (2 x float64)")
    assert isinstance(err.value.__cause__, RuntimeError)
    assert err.value.silent_ranks == []


def test_verify_passes_when_ranks_agree(world_of_one):
    log = CollectiveLog()
    log.verify = True
    log.record("all_reduce", "bucket 0", torch.zeros(3), bucket=0)
    log.record("broadcast_object", "checkpoint outcome")
    assert log.seq == 2


class _CutOffStore:
    """A store whose host is cut off: every call blocks (no reset ever comes)."""

    def __init__(self):
        self.release = threading.Event()

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.release.wait(60)


def test_an_unreachable_store_ends_the_explanation_within_the_wait_plus_margin(world_of_one, monkeypatch):
    store = _CutOffStore()
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(collective_log, "STORE_MARGIN_S", 0.5)
    monkeypatch.setenv("MASTER_ADDR", "10.213.0.1")
    monkeypatch.setenv("MASTER_PORT", "29400")
    slack_s = 300 * cpu_baseline_s()  # scheduling on a shared host: ~2.5 s quiet, more under load
    start = time.monotonic()
    with pytest.raises(CollectiveError) as err, explain_failures(CollectiveLog(), wait_s=0.5):
        raise RuntimeError("Connection closed by peer [10.213.0.2]:4021")
    store.release.set()
    assert time.monotonic() - start < 0.5 + 0.5 + slack_s  # wait + margin + slack
    assert "the store at 10.213.0.1:29400 did not answer within 1 s" in str(err.value)


def test_the_silent_ranks_are_a_field_of_the_error(world_of_one, monkeypatch):
    # the launcher's failure summary reads the field (through the worker's failure record), not the text
    answers = collective_log._PeerAnswers(reached=True, hosts={0: {"host": "node-03", "addr": "10.0.0.7"}})
    monkeypatch.setattr(collective_log, "_ask_peers", lambda *a: answers)
    with pytest.raises(CollectiveError) as err, explain_failures(CollectiveLog(), wait_s=0.5):
        raise RuntimeError("Timed out waiting 2000ms for recv operation to complete")
    assert err.value.silent_ranks == [0]
    assert "did not report within 0 s" in str(err.value)
