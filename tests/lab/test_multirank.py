"""The harness itself: failures and hangs must be loud, and nothing may be left running."""

import math
import os
import time

import pytest
import torch.distributed as dist

from dpscale.lab.multirank import MultiRankError, run_ranks
from support.timing import process_baseline_once_s, process_baseline_s


def add_rank(rank, world, base):
    return base + rank


@pytest.mark.slow
def test_results_come_back_in_rank_order_on_every_call():
    # many short calls: without the barrier after init, a rank that returned at once closed its
    # socket while a peer was still in gloo's handshake (about 1 call in 12 of 4 ranks failed)
    for base in range(12):
        assert run_ranks(add_rank, 4, base) == [base, base + 1, base + 2, base + 3]


def one_raises(rank, world):
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # rank 0 waits for the peer that died


@pytest.mark.slow
def test_failing_rank_shows_every_ranks_report():
    # waited for, the survivor would hold the run for the whole timeout; killed, it costs a few
    # process starts (~8 s quiet)
    bound_s = 3 * process_baseline_s()
    timeout_s = 300
    assert bound_s < timeout_s / 2, f"the host is too busy to tell a kill from a wait ({bound_s:.0f} s)"
    t0 = time.monotonic()
    with pytest.raises(MultiRankError) as err:
        run_ranks(one_raises, 2, timeout_s=timeout_s)
    msg = str(err.value)
    assert "rank one is broken" in msg and "--- rank 0:" in msg and "--- rank 1: raised" in msg
    assert time.monotonic() - t0 < bound_s, "the survivors must be killed, not waited for"


def sleeps_forever(rank, world):
    if rank == 0:
        time.sleep(3600)
    return rank


@pytest.mark.slow
@pytest.mark.waits  # on the harness's timeout
def test_hang_is_killed_at_timeout_with_stacks():
    # the test waits the timeout out: long enough for rank 1 to start, join and return (a fork of
    # the preloaded server, well under one process start of this host now: ~3 s quiet)
    timeout_s = max(2, math.ceil(process_baseline_once_s()))
    with pytest.raises(MultiRankError) as err:
        run_ranks(sleeps_forever, 2, timeout_s=timeout_s)
    msg = str(err.value)
    assert f"timed out after {timeout_s} s" in msg
    assert "sleeps_forever" in msg  # the stuck rank's Python stack
    assert "--- rank 1: ok" in msg


def pid_of(rank, world):
    return os.getpid()


@pytest.mark.slow
def test_no_rank_survives():
    pids = run_ranks(pid_of, 3)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_world_size_must_be_positive():
    with pytest.raises(ValueError):
        run_ranks(add_rank, 0, 1)


def what_a_rank_starts_with(rank, world):
    import sys

    threads = len(os.listdir(f"/proc/{os.getpid()}/task"))
    return threads, [m for m in ("torch._dynamo", "dpscale") if m in sys.modules]


@pytest.mark.slow
def test_ranks_start_with_the_preload_imported_and_no_other_thread():
    # torch's optimizers import torch._dynamo on their first parameter group (~1.2 s of CPU):
    # the forkserver pays that once, not every rank of every test (benchmarks/rank_startup.py)
    for threads, loaded in run_ranks(what_a_rank_starts_with, 2, backend=None):
        assert loaded == ["torch._dynamo", "dpscale"]
        assert threads == 1, "a rank forked from the server must hold only its own thread"
