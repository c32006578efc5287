"""The shm barriers' wait policies, with two 'ranks' as threads of this process (no process started).

Each rank's control line is mapped twice from one memfd, as a peer process maps it through
/proc/<pid>/fd: two addresses of the same file, so the futex the sleeper waits on is the one the
arriving rank wakes, exactly as between processes.
"""

import mmap
import os
import threading
import time

import pytest

from dpscale.comm import shm_wait
from dpscale.comm.shm import SharedMemoryTransport
from dpscale.comm.shm_wait import Counters, PeerTimeoutError


def two_ranks(wait: str, timeout_s: float = 60.0) -> list[Counters]:
    fds = [os.memfd_create("dpscale-test-ctl", os.MFD_CLOEXEC) for _ in range(2)]
    try:
        for fd in fds:
            os.ftruncate(fd, 64)
        # rank r's view of every line: its own mapping of each rank's file
        return [
            Counters([mmap.mmap(fd, 64) for fd in fds], r, timeout_s=timeout_s, wait=wait) for r in range(2)
        ]
    finally:
        for fd in fds:
            os.close(fd)


def run_pair(first, second, join_s: float = 30.0):
    """Run first() here while second() runs in a thread; return first()'s value."""
    errors = []

    def target():
        try:
            second()
        except BaseException as e:  # noqa: BLE001 - reported to the test below
            errors.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        return first()
    finally:
        thread.join(join_s)
        assert not thread.is_alive(), "the other rank never returned"
        assert not errors, errors


@pytest.mark.parametrize("wait", shm_wait.WAIT_POLICIES)
def test_barriers_pair_up_for_many_rounds(wait):
    r0, r1 = two_ranks(wait)

    def rounds(c):
        for _ in range(300):
            c.wait_all(c.arrive(), "test")
        return c.seq

    assert run_pair(lambda: rounds(r0), lambda: rounds(r1)) == 300
    assert r1.seq == 300


def test_block_sleeps_while_the_peer_is_late_and_its_arrival_wakes_it(monkeypatch):
    # the sleeper's own time-out slice outlasts the test: only the peer's wake-up can end its sleep
    monkeypatch.setattr(shm_wait, "_BLOCK_SLICE_S", 600.0)
    r0, r1 = two_ranks("block")
    sleeper = threading.Thread(target=lambda: r0.wait_all(r0.arrive(), "test"), daemon=True)
    sleeper.start()
    wchan = f"/proc/self/task/{sleeper.native_id}/wchan"
    # rank 1 arrives only once rank 0 is asleep in the kernel, on a futex
    deadline = time.monotonic() + 20
    while sleeper.is_alive() and "futex" not in open(wchan).read() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert r0.lines[0][shm_wait._ASLEEP_ON] == 2  # it told rank 1 whom it sleeps on
    r1.arrive()
    sleeper.join(20)
    assert not sleeper.is_alive(), "rank 1's arrival did not wake rank 0"
    assert r0.sleeps == 1
    assert r0.lines[0][shm_wait._ASLEEP_ON] == 0  # cleared once awake


def test_spin_never_sleeps_in_the_kernel():
    r0, r1 = two_ranks("spin")
    run_pair(lambda: r0.wait_all(r0.arrive(), "test"), lambda: r1.wait_all(r1.arrive(), "test"))
    assert r0.sleeps == 0 and r0.lines[0][shm_wait._ASLEEP_ON] == 0


@pytest.mark.parametrize("wait", shm_wait.WAIT_POLICIES)
def test_a_peer_that_never_arrives_is_named_after_the_timeout(wait, monkeypatch):
    monkeypatch.setattr(shm_wait, "_YIELD", 2100)  # spin: reach its timed sleeps quickly
    r0, _ = two_ranks(wait, timeout_s=0.05)
    with pytest.raises(PeerTimeoutError, match=r"rank 0 waited 0 s for rank 1 at collective #1 \(test\)"):
        r0.wait_all(r0.arrive(), "test")


def test_an_unknown_wait_policy_is_refused_before_any_collective():
    with pytest.raises(ValueError, match="wait='nap' is unknown; choose one of block, spin"):
        SharedMemoryTransport(wait="nap")
