"""The shm transport's barriers: per-rank arrival counters in shared memory, and how a rank waits.

Each rank owns two 64-byte control lines that every peer maps: the first starts with the count of
the collectives it has reached (the rest carries small payloads, shm_small.py), the second says
which peer (rank + 1) it is asleep on, 0 if none. The two are apart because the counter changes
every collective and the sleep slot almost never: a peer that checks whether this rank sleeps then
reads a line still in its own cache instead of fetching the counter's line from this rank's core.
Each slot is written by its owner alone, so plain stores and loads suffice: x86-64 keeps stores in
order (a peer that sees the counter also sees the data written before it).

Two ways to wait for a peer that is late (`WAIT_POLICIES`):

- `block` (the default): spin for a while (a peer that is about to arrive costs no system call),
  then sleep in the kernel on the peer's counter (Linux futex, the word under pthread mutexes)
  until the peer's arrival wakes it. A waiting rank then burns no CPU, which matters when the host
  has more runnable processes than cores: a spinning rank takes the core its late peer needs. The
  arriving rank makes the wake-up system call only when a peer has said it sleeps on it, so a
  quiet host pays nothing for this. How long to spin adapts: up to `_BLOCK_SPIN` checks (~100-150
  us) while the peers it sleeps on arrive soon after it gives up (more spinning would have caught
  them), down to `_BLOCK_SPIN_MIN` (a few us) while they arrive long after (they were not running:
  spinning only kept a CPU from them). When the ranks have fewer CPUs than ranks among them it
  spins only that minimum, then yields the CPU a few times (the late peer may be waiting for this
  very CPU) before it sleeps. A sleeping rank is woken, never polled, so unlike `sched_yield` it
  cannot lose a whole time slice to a busy process that shares its CPU.
- `spin`: spin, then `sched_yield`, then 0.5 ms sleeps (the transport's first policy; it keeps
  the fewest microseconds per barrier on an idle host with a core per rank, and yields the CPU
  only after milliseconds).

Past `timeout_s` a waiting rank raises and names the rank it waited for.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time

import numpy as np

WAIT_POLICIES = ("block", "spin")
_LINE = 16  # int64 slots per rank: two 64-byte cache lines (no line shared by two ranks' writes)
_COUNT, _ASLEEP_ON = 0, 8  # slots: the first of each line

# `spin`: busy checks before yielding (a peer microseconds behind), yields before sleeping
_SPIN = 2000
_YIELD = 20000
# `block`: busy checks before sleeping, ~100-150 us here (one check ~0.1 us, plus the loop). With
# 200 (~25 us) an idle host's small all-reduce took a ~60 us futex wake-up in half the runs (a peer
# that arrives 30-60 us late); 1000 removed it and cost nothing measurable on engine steps, quiet
# or with 5 busy processes (BENCHMARKS.md, "spin budget")
_BLOCK_SPIN = 1000
# `block`: the fewest busy checks before sleeping (~3-5 us: a peer running on another CPU and
# about to arrive), where spinning longer has not paid or the ranks share CPUs
_BLOCK_SPIN_MIN = 30
# `block`: a sleep longer than this means the peer was not running; a shorter one, that it was
# close and a longer spin would have caught it (the spin budget then halves or doubles)
_LONG_SLEEP_S = 0.0005
# `block`, ranks sharing CPUs: yields before sleeping. The late peer is then often runnable on this
# CPU, and a yield hands it the CPU with no futex wake-up to pay on its arrival (Open MPI yields
# likewise when it runs more processes than cores: its mpi_yield_when_idle). Few, and only then:
# a yield can hand a whole time slice to a busy process that shares the CPU.
_SHARED_CPU_YIELDS = 4
# The C helper's busy wait for its peers (shm_small.c) before it hands the wait to the policy
# here: ranks in step on a quiet host arrive within a few us of each other, and a check in C costs
# nanoseconds, so a few us catch them without a trip through Python
_NATIVE_SPIN_NS = 5000
# The C helper's time yielding the CPU to its peers, after that spin, when the ranks share CPUs
# (shm_small.c, `struct dps_wait`): 4 ranks on 2 cores, a 4 B all-reduce took 7-9 us with it
# against 22-55 us with a futex sleep after 4 yields (Open MPI 10-14 us)
_SHARED_CPU_YIELD_NS = 200_000
# A yield longer than this gave a time slice away (0.75-3 ms under Linux's scheduler) to something
# other than a peer about to arrive: a busy process sharing the CPU, or a peer still computing.
# The helper then stops yielding for _YIELD_BACKOFF[0] calls, twice as many after each further
# slow yield (up to [1]), half as many after each wait a yield ended.
_SLOW_YIELD_NS = 1_000_000
_YIELD_BACKOFF = (16, 1 << 16)
# A sleeper wakes at least this often to check its deadline; arrivals wake it at once.
_BLOCK_SLICE_S = 0.01

_SYS_FUTEX = 202  # x86-64 (shm runs only there, see select.shm_is_safe)
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_WAKE_ALL = 2**31 - 1


class PeerTimeoutError(RuntimeError):
    """A peer did not reach a collective in time."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long] * 7

# Acquiring and releasing a lock executes a locked (atomic) instruction, a full memory fence on
# x86-64: it orders "store my counter, then read whether a peer sleeps" against the sleeper's
# "store that I sleep, then read the counter", so one of the two always sees the other's store
# and no wake-up is lost (the futex itself then re-checks the counter in the kernel).
_fence_lock = threading.Lock()


def _fence() -> None:
    with _fence_lock:
        pass


class Counters:
    """The control lines of every rank (the first 64 bytes of `maps[j]`, rank j's control segment),
    and the wait policy."""

    def __init__(
        self, maps: list[mmap.mmap], rank: int, *, timeout_s: float, wait: str, oversubscribed: bool = False
    ):
        assert wait in WAIT_POLICIES, wait  # checked by the transport, before any collective
        self.maps = maps  # kept: the arrays below are views of them
        self.lines = [np.frombuffer(m, dtype=np.int64, count=_LINE) for m in maps]
        self.rank = rank
        self.timeout_s = timeout_s
        self.wait = wait
        self._mine = self.lines[rank]
        self._peers = [j for j in range(len(maps)) if j != rank]
        self._addrs = [line.ctypes.data for line in self.lines]
        sec, frac = divmod(_BLOCK_SLICE_S, 1.0)
        self._slice = _Timespec(int(sec), int(frac * 1e9))
        self.sleeps = 0  # times this rank slept in the kernel (block policy): for tests and probes
        # `block`: busy checks before sleeping, adapted between the minimum and this cap
        self._spin_cap = _BLOCK_SPIN_MIN if oversubscribed else _BLOCK_SPIN
        self.spin_budget = self._spin_cap
        self._yields = _SHARED_CPU_YIELDS if oversubscribed else 0
        self._oversubscribed = oversubscribed

    def native_wait(self) -> dict[str, int]:
        """How the C helper waits before it hands a wait to this class (shm_native.Wait): it spins
        where each rank has a CPU, and yields the CPU to its peers where they share CPUs (a late peer
        may need this one)."""
        if not self._oversubscribed:
            return {"spin_ns": _NATIVE_SPIN_NS}
        low, high = _YIELD_BACKOFF
        return {
            "yield_ns": _SHARED_CPU_YIELD_NS,
            "slow_ns": _SLOW_YIELD_NS,
            "backoff_min": low,
            "backoff_max": high,
        }

    @property
    def seq(self) -> int:
        """The collectives this rank has reached: its counter, which the C helper advances too."""
        return int(self._mine[_COUNT])

    def arrive(self) -> int:
        seq = int(self._mine[_COUNT]) + 1
        self._mine[_COUNT] = seq
        if self.wait == "block":
            _fence()
            me = self.rank + 1
            lines = self.lines
            for j in self._peers:
                if lines[j][_ASLEEP_ON] == me:
                    _syscall(_SYS_FUTEX, self._addrs[self.rank], _FUTEX_WAKE, _WAKE_ALL, 0, 0, 0)
                    break
        return seq

    def wait_all(self, seq: int, what: str) -> None:
        lines = self.lines
        for j in self._peers:
            if lines[j][_COUNT] < seq:
                if self.wait == "block":
                    self._block_on(j, seq, what)
                else:
                    self._spin_on(j, seq, what)

    def _spin_on(self, j: int, seq: int, what: str) -> None:
        ctl = self.lines[j]
        spins, deadline = 0, None
        while ctl[_COUNT] < seq:
            spins += 1
            if spins < _SPIN:
                continue
            if spins < _YIELD:
                os.sched_yield()
                continue
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.timeout_s
            elif now > deadline:
                raise self._timeout(j, seq, what)
            time.sleep(0.0005)

    def _block_on(self, j: int, seq: int, what: str) -> None:
        ctl = self.lines[j]
        for _ in range(self.spin_budget):
            if ctl[_COUNT] >= seq:
                return
        for _ in range(self._yields):
            os.sched_yield()
            if ctl[_COUNT] >= seq:
                return
        start = time.monotonic()
        self._sleep_on(j, seq, what, start + self.timeout_s)
        self._adapt(time.monotonic() - start)

    def _adapt(self, slept_s: float) -> None:
        """After a sleep of `slept_s`: spin longer next time if the peer came soon, else shorter."""
        if slept_s < _LONG_SLEEP_S:
            self.spin_budget = min(self._spin_cap, self.spin_budget * 2)
        else:
            self.spin_budget = max(_BLOCK_SPIN_MIN, self.spin_budget // 2)

    def _sleep_on(self, j: int, seq: int, what: str, deadline: float) -> None:
        ctl = self.lines[j]
        mine, addr, slice_addr = self._mine, self._addrs[j], ctypes.addressof(self._slice)
        while True:
            mine[_ASLEEP_ON] = j + 1
            _fence()
            seen = int(ctl[_COUNT])
            if seen >= seq:
                break
            # sleeps only while the counter's low 32 bits (the futex word) still read `seen`
            _syscall(_SYS_FUTEX, addr, _FUTEX_WAIT, seen & 0xFFFFFFFF, slice_addr, 0, 0)
            self.sleeps += 1
            if ctl[_COUNT] >= seq:
                break
            if time.monotonic() > deadline:
                mine[_ASLEEP_ON] = 0
                raise self._timeout(j, seq, what)
        mine[_ASLEEP_ON] = 0

    def _timeout(self, j: int, seq: int, what: str) -> PeerTimeoutError:
        return PeerTimeoutError(
            f"shm transport: rank {self.rank} waited {self.timeout_s:.0f} s for rank {j} at "
            f"collective #{seq} ({what}); rank {j} last reached #{int(self.lines[j][_COUNT])}: it "
            "died, hangs, or issued different collectives"
        )
