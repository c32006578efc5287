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

CTL = shm_wait._LINE * 8  # bytes of a rank's control lines


def two_ranks(wait: str, timeout_s: float = 60.0) -> list[Counters]:
    fds = [os.memfd_create("dpscale-test-ctl", os.MFD_CLOEXEC) for _ in range(2)]
    try:
        for fd in fds:
            os.ftruncate(fd, CTL)
        # rank r's view of every line: its own mapping of each rank's file
        return [
            Counters([mmap.mmap(fd, CTL) for fd in fds], r, timeout_s=timeout_s, wait=wait) for r in range(2)
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


def test_block_spins_less_after_a_long_sleep_and_more_after_a_short_one():
    r0, _ = two_ranks("block")
    assert r0.spin_budget == shm_wait._BLOCK_SPIN
    r0._adapt(2 * shm_wait._LONG_SLEEP_S)  # the peer was not running: spinning did not help
    assert r0.spin_budget == shm_wait._BLOCK_SPIN // 2
    for _ in range(20):
        r0._adapt(2 * shm_wait._LONG_SLEEP_S)
    assert r0.spin_budget == shm_wait._BLOCK_SPIN_MIN
    r0._adapt(shm_wait._LONG_SLEEP_S / 10)  # the peer came just after: a longer spin would have caught it
    assert r0.spin_budget == 2 * shm_wait._BLOCK_SPIN_MIN
    for _ in range(20):
        r0._adapt(0.0)
    assert r0.spin_budget == shm_wait._BLOCK_SPIN


def test_ranks_that_share_cpus_spin_only_briefly():
    fd = os.memfd_create("dpscale-test-ctl", os.MFD_CLOEXEC)
    os.ftruncate(fd, CTL)
    c = Counters([mmap.mmap(fd, CTL)] * 2, 0, timeout_s=1, wait="block", oversubscribed=True)
    os.close(fd)
    assert c.spin_budget == shm_wait._BLOCK_SPIN_MIN
    c._adapt(0.0)
    assert c.spin_budget == shm_wait._BLOCK_SPIN_MIN
    assert c._yields == shm_wait._SHARED_CPU_YIELDS  # then yield to the peer that may need the CPU
    assert two_ranks("block")[0]._yields == 0  # never when each rank can have a CPU of its own


def test_a_peer_that_arrives_long_after_halves_the_spin(monkeypatch):
    monkeypatch.setattr(shm_wait, "_LONG_SLEEP_S", 0.01)
    r0, r1 = two_ranks("block")

    def late():
        time.sleep(0.2)  # far past the spin (~0.1 ms) and the long-sleep mark
        r1.arrive()

    run_pair(lambda: r0.wait_all(r0.arrive(), "test"), late)
    assert r0.sleeps >= 1
    assert r0.spin_budget == shm_wait._BLOCK_SPIN // 2
