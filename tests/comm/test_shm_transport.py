"""The shared-memory transport against torch.distributed, for random sizes, dtypes and world sizes.

Tolerances: fp32/fp64 results are compared with gloo's all-reduce of the same data (rtol 1e-6 /
1e-12: a different order of additions); fp16/bf16 with the fp64 sum rounded once, allowing the
roundings of the inputs' partial sums (fp16 2**-10, bf16 2**-7 relative, plus a small absolute
term for sums near zero).
"""

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpscale.comm import PeerTimeoutError, SharedMemoryTransport, chunk_bounds
from dpscale.comm.shm import WAIT_POLICIES
from dpscale.lab.multirank import MultiRankError, run_ranks
from support.timing import cpu_baseline_s

pytestmark = pytest.mark.slow  # starts processes (spawned ranks or the CLI)

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
TOL = {
    "float32": (1e-6, 1e-6),
    "float64": (1e-12, 1e-12),
    "float16": (2e-3, 2e-3),
    "bfloat16": (1.6e-2, 1.6e-2),
}


def data_for(rank: int, numel: int, dtype: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(DTYPES[dtype])


def check_cases(rank, world, cases):
    # both wait policies, case by case, in the same ranks
    transports = [SharedMemoryTransport(timeout_s=60, wait=w) for w in WAIT_POLICIES]
    errors = []
    for i, (numel, dtype, seed, in_segment) in enumerate(cases):
        t = transports[i % len(transports)]
        mine = data_for(rank, numel, dtype, seed)
        expected = sum(data_for(j, numel, dtype, seed).double() for j in range(world)).to(DTYPES[dtype])
        if in_segment:
            buf = t.alloc(numel, DTYPES[dtype])
            buf.copy_(mine)
        else:
            buf = mine.clone()
        for repeat in range(2):  # reusing the same buffer must work
            if repeat:
                buf.copy_(mine)
            t.all_reduce(buf).wait()
            rtol, atol = TOL[dtype]
            if not torch.allclose(buf.double(), expected.double(), rtol=rtol, atol=atol * world):
                errors.append((numel, dtype, seed, in_segment, repeat))
        if dtype in ("float32", "float64"):
            ref = mine.clone()
            dist.all_reduce(ref)
            if not torch.allclose(buf, ref, rtol=TOL[dtype][0], atol=TOL[dtype][1]):
                errors.append(("vs gloo", numel, dtype))
    for t in transports:
        t.close()
    return errors


case = st.tuples(
    st.one_of(st.integers(1, 17), st.integers(18, 5000), st.sampled_from([2**16 + 3, 2**18])),
    st.sampled_from(sorted(DTYPES)),
    st.integers(0, 10**6),
    st.booleans(),
)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cases=st.lists(case, min_size=4, max_size=8))
def test_all_reduce_matches_torch_distributed(world, cases):
    for errors in run_ranks(check_cases, world, cases, timeout_s=120):
        assert errors == []


def other_collectives(rank, world):
    t = SharedMemoryTransport(timeout_s=60)
    n = 7  # not divisible by most world sizes
    x = t.alloc(n, torch.float32)
    x.copy_(torch.arange(n, dtype=torch.float32) + 10 * rank)
    out = {}
    b = x.clone()
    t.broadcast(b, src=world - 1)
    out["broadcast"] = b
    # a tensor of the caller's, not contiguous: staged in logical order, copied back in place
    m = (torch.arange(12, dtype=torch.float32).view(3, 4) + 100 * rank).t()
    t.broadcast(m, src=world - 1)
    out["broadcast_transposed"] = m
    g = torch.empty(world * n)
    t.all_gather(g, x)
    out["all_gather"] = g
    lo, hi = chunk_bounds(n, world, rank)
    rs = torch.empty(hi - lo)
    t.reduce_scatter(rs, x)
    out["reduce_scatter"] = rs
    t.barrier()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_broadcast_all_gather_reduce_scatter(world):
    n = 7
    base = torch.arange(n, dtype=torch.float32)
    total = sum(base + 10 * r for r in range(world))
    for rank, out in enumerate(run_ranks(other_collectives, world)):
        torch.testing.assert_close(out["broadcast"], base + 10 * (world - 1))
        expected = (torch.arange(12, dtype=torch.float32).view(3, 4) + 100 * (world - 1)).t()
        torch.testing.assert_close(out["broadcast_transposed"], expected)
        torch.testing.assert_close(out["all_gather"], torch.cat([base + 10 * r for r in range(world)]))
        lo, hi = chunk_bounds(n, world, rank)
        torch.testing.assert_close(out["reduce_scatter"], total[lo:hi])


def segments_now(rank, world):
    t = SharedMemoryTransport(timeout_s=60)
    t.alloc(1000, torch.float32)
    t.barrier()
    left = [n for n in os.listdir("/dev/shm") if "dpscale" in n]
    t.close()
    return left


def test_segments_are_unlinked_once_mapped():
    # even while the transport is alive, nothing is left in /dev/shm: all were unlinked after mapping
    assert run_ranks(segments_now, 2) == [[], []]


def named_segments_mapped(rank, world):
    t = SharedMemoryTransport(timeout_s=60)
    buf = t.alloc(1000, torch.float32)
    buf.fill_(rank + 1)
    t.all_reduce(buf)
    maps = open("/proc/self/maps").read().splitlines()
    t.close()
    return float(buf[0]), [line.split(None, 5)[-1] for line in maps if "/dev/shm/" in line]


def test_segments_never_have_a_name_another_user_could_take_or_a_kill_could_leave():
    """Before, each segment was a name in /dev/shm for a moment: another local user could pre-create
    the next names (set-up failed with FileExistsError) and a kill -9 during set-up left them behind.
    Now the segments are memfds: no process of the job maps anything under /dev/shm, even deleted."""
    assert run_ranks(named_segments_mapped, 2) == [(3.0, []), (3.0, [])]


def dies_mid_run(rank, world, report_path):
    # well inside the harness's grace period for survivors of a failed rank (3 s)
    t = SharedMemoryTransport(timeout_s=1.5)
    buf = t.alloc(1 << 16, torch.float32)
    t.all_reduce(buf)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        t.all_reduce(buf)
    except PeerTimeoutError as e:
        with open(report_path, "w") as f:
            f.write(f"{time.monotonic() - t0:.1f}\n{e}")


def test_killed_peer_is_named_within_the_timeout_and_leaves_nothing_behind(tmp_path):
    report = tmp_path / "rank0.txt"
    with pytest.raises(MultiRankError) as err:
        run_ranks(dies_mid_run, 2, str(report), timeout_s=60)
    assert "--- rank 1: exited with code -9" in str(err.value)
    waited, msg = report.read_text().split("\n", 1)
    # the transport's 1.5 s timeout, plus the scheduling of a few wake-ups on a busy host (~1 s
    # quiet); past the harness's 3 s grace for survivors rank 0 is killed before it reports, which
    # fails the test as well
    assert 1.5 <= float(waited) < 1.5 + 100 * cpu_baseline_s(), waited
    assert "for rank 1" in msg
    assert not [n for n in os.listdir("/dev/shm") if "dpscale" in n]


def stuck_message(rank, world, done_path):
    t = SharedMemoryTransport(timeout_s=2)
    buf = t.alloc(64, torch.float32)
    done = Path(done_path)
    if rank == 1:  # silent but alive until rank 0 has its error (a fixed sleep is too short under
        # load and longer than needed on a quiet host)
        deadline = time.monotonic() + 30
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return "slept"
    try:
        t.all_reduce(buf)
    except PeerTimeoutError as e:
        return str(e)
    finally:
        done.touch()
    return "no error"


@pytest.mark.waits  # on the transport's timeout, with rank 1 asleep
def test_timeout_message_names_the_missing_rank(tmp_path):
    msg, slept = run_ranks(stuck_message, 2, str(tmp_path / "done"), timeout_s=60)
    assert slept == "slept"
    assert "waited 2 s for rank 1" in msg and "collective #1" in msg
