"""The shm transport's one-round path for small tensors, between real ranks.

Each rank holds three transports: one as shipped (small float all-reduces in the C helper where
it builds), one with the one-round path in Python, and one with the one-round path turned off
(every size through the in-place path, as before it existed). Sizes around the threshold, every dtype,
in the segments and not, must come out with the same bits from all three, on every rank, and equal to
the sum in the order `sum_order` defines. The ranks call in uneven rhythm (random short pauses)
and mix one-round calls with in-place ones and barriers, so a mailbox refilled too early would
show as a wrong sum.
"""

import os
import random
import subprocess
import sys
import time

import pytest
import torch

from dpscale.comm import SharedMemoryTransport, chunk_bounds, shm_native, shm_small, shm_wait
from dpscale.comm.sum_order import part_order, sum_into
from dpscale.lab.multirank import run_ranks

pytestmark = pytest.mark.slow  # starts processes (spawned ranks)

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _sizes(dtype: torch.dtype) -> list[int]:
    item = torch.empty(0, dtype=dtype).element_size()
    # around every limit (flagged words, the Python path's, the C helper's): the one above each goes
    # another way
    limits = {
        shm_small.SMALL_MAX_BYTES // item,
        shm_small.NATIVE_SMALL_MAX_BYTES // item,  # ranks on CPUs of their own
        shm_small.NATIVE_SMALL_MAX_BYTES_SHARED_CPUS // item,  # more ranks than CPUs (3 or 4 here)
    }
    line = shm_small.LINE_PAYLOAD_BYTES // item
    flagged = {shm_small.LL_MAX_BYTES // item, shm_small.LL_MAX_BYTES_SHARED_CPUS // item}
    return [1, line, line + 1, *(n for most in sorted(flagged) for n in (most, most + 1)), 1000] + [
        n for most in sorted(limits) for n in (most - 1, most, most + 1)
    ]


def _data(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 10 + rank)
    scale = torch.pow(10.0, torch.randint(-4, 5, (numel,), generator=g).double())
    return (torch.randn(numel, generator=g, dtype=torch.float64) * scale).to(dtype)


def _expected(xs: list[torch.Tensor]) -> torch.Tensor:
    world, numel = len(xs), xs[0].numel()
    out = torch.empty_like(xs[0])
    for p in range(world):
        lo, hi = chunk_bounds(numel, world, p)
        sum_into(out[lo:hi], [xs[j][lo:hi] for j in part_order(p, world)])
    return out


def _reduce(t: SharedMemoryTransport, x: torch.Tensor, in_segment: bool) -> torch.Tensor:
    buf = t.alloc(x.numel(), x.dtype) if in_segment else x.clone()
    if in_segment:
        buf.copy_(x)
    t.all_reduce(buf).wait()
    return buf.clone()


def both_paths(rank: int, world: int) -> list[tuple]:
    before = shm_small.SMALL_MAX_BYTES
    shm_small.SMALL_MAX_BYTES = 0
    try:
        in_place = SharedMemoryTransport(timeout_s=60)
    finally:
        shm_small.SMALL_MAX_BYTES = before
    shipped = SharedMemoryTransport(timeout_s=60)
    python = _transport(python_only=True)
    pause = random.Random(rank)
    out, seed = [], 0
    for dtype in DTYPES:
        for numel in _sizes(dtype):
            for in_segment in (True, False):
                seed += 1
                xs = [_data(j, numel, dtype, seed) for j in range(world)]
                time.sleep(pause.choice([0, 0, 0.0002, 0.002]))  # ranks out of step
                got = _reduce(shipped, xs[rank], in_segment)
                want = _reduce(in_place, xs[rank], in_segment)
                in_python = _reduce(python, xs[rank], in_segment)
                out.append((dtype, numel, in_segment, got, want, _expected(xs), in_python))
                if seed % 3 == 0:
                    shipped.barrier()  # shifts which mailbox the next call fills
    shipped.close()
    in_place.close()
    python.close()
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_one_round_path_gives_the_in_place_bits_on_every_rank(world):
    per_rank = run_ranks(both_paths, world, timeout_s=240)
    for rank, cases in enumerate(per_rank):
        for (dtype, numel, in_segment, got, want, expected, in_python), first in zip(
            cases, per_rank[0], strict=True
        ):
            what = (rank, dtype, numel, in_segment)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), what
            assert torch.equal(got.view(torch.uint8), in_python.view(torch.uint8)), what
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), what
            assert torch.equal(got.view(torch.uint8), first[3].view(torch.uint8)), what  # same on every rank
    assert not [n for n in os.listdir("/dev/shm") if "dpscale" in n]


def _transport(python_only: bool) -> SharedMemoryTransport:
    """The transport, its small all-reduces in C where the helper builds, or in Python."""
    if not python_only:
        return SharedMemoryTransport(timeout_s=60)
    shipped = shm_native.library
    shm_native.library = lambda: None  # type: ignore[method-assign]
    try:
        return SharedMemoryTransport(timeout_s=60)
    finally:
        shm_native.library = shipped  # type: ignore[method-assign]


def many_small_calls(rank: int, world: int, calls: int, python_ranks: tuple[int, ...] = ()) -> list[str]:
    t = _transport(rank in python_ranks)
    buf = t.alloc(64, torch.float32)
    tiny = t.alloc(shm_small.LINE_PAYLOAD_BYTES // 4, torch.float32)  # rides in the control line
    flagged = t.alloc(16, torch.float32)  # 64 B: posted as flagged words (as `buf`, 256 B)
    big = t.alloc(shm_small.NATIVE_SMALL_MAX_BYTES_SHARED_CPUS, torch.float32)  # 4x the largest limit
    pause = random.Random(rank + 100)
    wrong = []
    for i in range(calls):
        if pause.random() < 0.2:
            time.sleep(pause.choice([0.00005, 0.0005]))
        buf.copy_(torch.arange(64, dtype=torch.float32) * (rank + 1) + i)
        t.all_reduce(buf)
        want = torch.arange(64, dtype=torch.float32) * (world * (world + 1) / 2) + world * i
        if not torch.equal(buf, want):
            wrong.append(f"call {i}: {buf[:4].tolist()} != {want[:4].tolist()}")
        for k in range(4):  # back to back: the second of each fills the other mailbox
            if pause.random() < 0.2:
                time.sleep(pause.choice([0.00005, 0.0005]))
            small = tiny if k < 2 else flagged
            small.fill_(float(rank + i + k))
            t.all_reduce(small)
            if not bool((small == world * (world - 1) / 2 + world * (i + k)).all()):
                wrong.append(f"call {i}.{k}: {small.tolist()}")
        if i % 7 == 0:
            big.fill_(1.0)
            t.all_reduce(big)
            if not bool((big == world).all()):
                wrong.append(f"call {i}: in-place all-reduce wrong")
    spin = t._ctl.spin_budget
    path = "C" if t._mail.native is not None else "Python"
    t.close()
    return [*wrong, f"spin {spin}", path]


@pytest.mark.parametrize("python_ranks", [(), (1,)], ids=["as-shipped", "rank-1-without-helper"])
def test_back_to_back_small_calls_in_uneven_step_never_read_a_refilled_mailbox(python_ranks):
    # as shipped (the C helper where it builds), and with one rank that has no helper: then every
    # rank takes the Python path and its limit (ranks that differed would lay out different
    # mailboxes and send a tensor down different paths)
    for result in run_ranks(many_small_calls, 3, 400, python_ranks, timeout_s=120):
        assert result[:-2] == []
        assert result[-1] == ("Python" if python_ranks or shm_native.library() is None else "C")


def pinned_to_one_cpu(rank: int, world: int) -> tuple[int, float]:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    t = SharedMemoryTransport(timeout_s=60)
    buf = torch.full((10,), float(rank + 1))
    for _ in range(20):
        buf.fill_(float(rank + 1))
        t.all_reduce(buf)
    cap = t._ctl._spin_cap
    t.close()
    return cap, float(buf[0])


def test_ranks_sharing_one_cpu_spin_only_briefly_and_still_sum():
    for cap, value in run_ranks(pinned_to_one_cpu, 2, timeout_s=120):
        assert cap == shm_wait._BLOCK_SPIN_MIN
        assert value == 3.0


def calls_on_one_cpu(rank: int, world: int, calls: int, numel: int = 1) -> dict:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    t = SharedMemoryTransport(timeout_s=60)
    buf = t.alloc(numel, torch.float32)
    wrong = 0
    for i in range(calls):
        buf.fill_(float(rank + i))
        t.all_reduce(buf)
        wrong += not bool((buf == world * (world - 1) / 2 + world * i).all())
    native, barriers = t._mail.native, t._barrier_wait
    assert native is not None and barriers is not None
    out = {"wrong": wrong, "yielded": native.wait.yielded, "slow": native.wait.slow, "sleeps": t._ctl.sleeps}
    out |= {"barrier_yielded": barriers.wait.yielded, "barrier_slow": barriers.wait.slow}
    out |= {"ll_max": t._mail.ll_max_bytes, "flagged": t._mail.flagged(numel * 4, torch.float32)}
    t.close()
    return out


@pytest.fixture
def helper_or_skip():
    if shm_native.library() is None:
        pytest.skip("no C compiler here: the C helper's wait is not in use")


@pytest.mark.parametrize("numel", [1, 16], ids=["in-the-control-line", "flagged-words"])
def test_ranks_sharing_one_cpu_hand_it_to_each_other_instead_of_sleeping(helper_or_skip, numel):
    calls = 2000
    for got in run_ranks(calls_on_one_cpu, 2, calls, numel, timeout_s=120):
        assert got["wrong"] == 0
        assert got["ll_max"] == shm_small.LL_MAX_BYTES_SHARED_CPUS and got["flagged"] == (numel == 16)
        # a rank that arrives first (about every other call) finds its peer arrived once it has
        # yielded the CPU to it, and sleeps in the kernel almost never (a futex sleep and wake-up
        # cost ~3x as much). Not every such call: another process that takes the CPU during a
        # yield (a busy test beside this one) stops the yielding for a while.
        assert got["yielded"] > (calls // 10 if got["slow"] == 0 else 0), got
        assert got["sleeps"] < calls // 10, got


def test_the_in_place_paths_barriers_yield_to_peers_on_a_shared_cpu_too(helper_or_skip):
    calls, numel = 300, shm_small.NATIVE_SMALL_MAX_BYTES_SHARED_CPUS // 4 * 4  # 4x the one-round limit
    for got in run_ranks(calls_on_one_cpu, 2, calls, numel, timeout_s=120):
        assert got["wrong"] == 0 and got["yielded"] == 0  # no call took the one-round path
        # two barriers a call: most end in the helper's yields, almost none in a futex sleep
        assert got["barrier_yielded"] > (calls // 5 if got["barrier_slow"] == 0 else 0), got
        assert got["sleeps"] < calls // 10, got


def test_a_busy_process_on_the_shared_cpu_stops_the_yielding_for_a_while(helper_or_skip):
    # A yield that hands the CPU to a busy process costs its whole time slice; after one, the
    # helper stops yielding for a while, longer after each further one (without this backoff,
    # 273 slow yields in 1500 calls here, against 6-37, and 75-96 yields in all on a later day's
    # host: each yield that ends the wait halves the pause, so the two come in proportion).
    cpu = min(os.sched_getaffinity(0))
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(hog.pid, {cpu})
        calls = 1500
        for got in run_ranks(calls_on_one_cpu, 2, calls, timeout_s=300):
            assert got["wrong"] == 0
            assert got["slow"] > 0 and got["slow"] + got["yielded"] < calls // 8, got
    finally:
        hog.kill()
        hog.wait()


def _in_place_transport() -> SharedMemoryTransport:
    before = shm_small.SMALL_MAX_BYTES
    shm_small.SMALL_MAX_BYTES = 0
    try:
        return SharedMemoryTransport(timeout_s=60)
    finally:
        shm_small.SMALL_MAX_BYTES = before


def same_address_other_tensors(rank: int, world: int) -> list[tuple]:
    """Tensors that share the address of one reduced before, but not its size, dtype, layout or
    segment: each must be reduced as itself (a binding is reused for its key alone)."""
    shipped, in_place = SharedMemoryTransport(timeout_s=60), _in_place_transport()
    out = []

    def check(what: str, make) -> None:
        # twice (the second call takes the hot path), as the in-place path sums the same values;
        # the Future's value is the tensor passed (`make` may give a new view of it each time)
        for seed in (1, 2):
            x = make()
            x.copy_(_data(rank, x.numel(), x.dtype, seed).view(x.shape))
            reference = _data(rank, x.numel(), x.dtype, seed).view(x.shape).clone()
            fut = shipped.all_reduce(x)
            in_place.all_reduce(reference)
            out.append((what, seed, x.clone(), reference, fut.value() is x and fut.wait() is x))

    store = torch.zeros(16)  # a caller's memory, viewed in several ways at one address
    check("private float32", lambda: store[:4])
    check("private float64, same address", lambda: store.view(torch.float64)[:4])
    check("private float32, same address, transposed", lambda: store[:4].view(2, 2).t())
    check("private float32, same address, fewer", lambda: store[:3])
    seg = shipped.alloc(16, torch.float32)
    check("segment float32", lambda: seg[:4])
    check("segment float64, same address", lambda: seg.view(torch.float64)[:4])
    check("segment float32, same address, transposed", lambda: seg[:4].view(2, 2).t())
    # released and mapped again, likely at the same address: small (mailboxes) and in place (the
    # peers' segments, which must be the new ones)
    numel = 16 + 2 * shm_small.NATIVE_SMALL_MAX_BYTES_SHARED_CPUS // 4
    for _ in range(2):
        old_ptr = seg.data_ptr()
        shipped.release(seg)
        del seg
        seg = shipped.alloc(numel, torch.float32)
        again = f"(same address: {seg.data_ptr() == old_ptr})"
        check(f"segment after release {again}", lambda seg=seg: seg[:4])
        check(f"segment after release, in place {again}", lambda seg=seg: seg)
    shipped.close()
    in_place.close()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_binding_serves_only_the_address_size_dtype_and_layout_it_was_made_for(world):
    per_rank = run_ranks(same_address_other_tensors, world, timeout_s=120)
    for rank, cases in enumerate(per_rank):
        for what, seed, got, want, future_is_tensor in cases:
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), (
                rank,
                what,
                seed,
            )
            assert future_is_tensor, (rank, what, seed)
