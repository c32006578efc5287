"""The C helper of the one-round path (shm_small.c, built by shm_native.py) gives the Python
path's bits, speaks its protocol, and is skipped cleanly where it cannot be built.

In one process: every "rank" has its control line and mailboxes in a mapping of its own, laid out
as the transport lays them out, so a rank on the C path and one on the Python path can take part
in the same all-reduce. Tests that need the helper built are `slow`: the first build starts the
compiler, a process the fast tier does not allow.
"""

import ctypes
import mmap
import os
import stat

import numpy as np
import pytest
import torch

from dpscale.comm import shm_native, shm_small
from dpscale.comm.shm_small import Mailboxes, NativeCalls
from dpscale.comm.shm_wait import Counters

OFFSET = 4096  # as the transport: the control line's page first
CAPACITY = 8192


@pytest.fixture(params=["module", "ctypes"])
def helper(request) -> shm_native.Helper:
    """The helper as library() loads it here (an extension module where the interpreter's headers
    are installed), and as the plain library called through ctypes (where they are not)."""
    built = shm_native.library()
    if built is None:
        pytest.skip("no C compiler: the helper cannot be built")
    if request.param == "ctypes":
        return shm_native.Helper(ctypes.PyDLL(str(shm_native._built(as_module=False))))
    if not built.module:
        pytest.skip("no Python.h: the helper is not built as a module here")
    return built


# starts the compiler on first use; then needs the built helper
needs_helper = pytest.mark.slow


def _data(world: int, numel: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # magnitudes over many binades, so a different order of additions would change low bits
    scale = torch.pow(10.0, torch.randint(-4, 5, (numel,), generator=g).double())
    xs = [(torch.randn(numel, generator=g, dtype=torch.float64) * scale).to(dtype) for _ in range(world)]
    xs[0][:1] = float("inf")  # specials go through the same IEEE additions
    xs[-1][-1:] = -0.0
    return xs


def _maps(world: int) -> list[mmap.mmap]:
    return [mmap.mmap(-1, OFFSET + 2 * CAPACITY) for _ in range(world)]


def _native(helper: shm_native.Helper, spin_ns: int = 0) -> NativeCalls:
    return NativeCalls(helper, wake=True, wait=shm_native.Wait(spin_ns=spin_ns))


def _one_round(boxes: list[Mailboxes], xs: list[torch.Tensor], slot: int) -> list[torch.Tensor]:
    outs = [x.clone() for x in xs]
    calls = [b.bind(out) for b, out in zip(boxes, outs, strict=True)]
    for call in calls:
        call.post(slot)
    for call in calls:
        call.sum(slot)
    return outs


@needs_helper
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_the_c_sum_gives_the_python_sums_bits(helper, world, dtype):
    item = torch.empty(0, dtype=dtype).element_size()
    maps = _maps(world)
    python = [Mailboxes(maps, OFFSET, CAPACITY, r) for r in range(world)]
    native = [Mailboxes(maps, OFFSET, CAPACITY, r, _native(helper)) for r in range(world)]
    flagged = shm_small.LL_MAX_BYTES // item
    for seed, numel in enumerate(
        [1, 3, 17, flagged, flagged + 1, 1001, CAPACITY // item - 1, CAPACITY // item]
    ):
        xs = _data(world, numel, dtype, seed)
        for slot in (0, 1):
            want = _one_round(python, xs, slot)
            got = _one_round(native, xs, slot)
            for r in range(world):
                assert torch.equal(got[r].view(torch.uint8), want[r].view(torch.uint8)), (r, numel, slot)
                assert torch.equal(got[r].view(torch.uint8), got[0].view(torch.uint8))


@needs_helper
def test_half_types_stay_on_the_python_path(helper):
    boxes = Mailboxes(_maps(2), OFFSET, CAPACITY, 0, _native(helper))
    assert boxes.bind(torch.zeros(4, dtype=torch.bfloat16)).native is None
    assert boxes.bind(torch.zeros(4, dtype=torch.float32)).native is not None


@needs_helper
def test_a_c_rank_and_a_python_rank_reduce_together_and_keep_one_count(helper):
    """Rank 1 (Python) posts and arrives first; rank 0 (C) then finds it there within its spin,
    sums, and leaves; rank 1 sums. Both counters advance as one sequence, mailboxes alternate."""
    maps = _maps(2)
    ctl = [Counters(maps, r, timeout_s=5, wait="block") for r in range(2)]
    c_rank = Mailboxes(maps, OFFSET, CAPACITY, 0, _native(helper, spin_ns=1_000_000))
    py_rank = Mailboxes(maps, OFFSET, CAPACITY, 1)
    for call in range(4):
        xs = _data(2, 100, torch.float32, call)  # 400 B: above the flagged words, which only C posts
        outs = [x.clone() for x in xs]
        mine, theirs = c_rank.bind(outs[0]), py_rank.bind(outs[1])
        seq = ctl[1].seq + 1
        theirs.post(seq)
        ctl[1].arrive()
        mine.run(ctl[0])
        theirs.sum(seq & 1)
        assert ctl[0].seq == ctl[1].seq == call + 1
        assert torch.equal(outs[0].view(torch.uint8), outs[1].view(torch.uint8))
        assert torch.equal(outs[0], xs[0] + xs[1])


@needs_helper
def test_which_sizes_are_posted_as_flagged_words(helper):
    boxes = Mailboxes(_maps(2), OFFSET, CAPACITY, 0, _native(helper))
    f32 = torch.float32
    assert not boxes.flagged(shm_small.LINE_PAYLOAD_BYTES, f32)  # the control line's slots
    assert boxes.flagged(shm_small.LINE_PAYLOAD_BYTES + 4, f32) and boxes.flagged(shm_small.LL_MAX_BYTES, f32)
    assert not boxes.flagged(shm_small.LL_MAX_BYTES + 4, f32)
    assert boxes.flagged(64, torch.float64) and not boxes.flagged(64, torch.bfloat16)  # C's dtypes only
    shared = Mailboxes(_maps(2), OFFSET, CAPACITY, 0, _native(helper), ll_max_bytes=64)  # ranks share CPUs
    assert shared.flagged(64, f32) and not shared.flagged(68, f32)
    python = Mailboxes(_maps(2), OFFSET, CAPACITY, 0)  # no helper: the Python path posts plainly
    assert not python.flagged(64, f32)


@needs_helper
def test_flagged_words_hold_the_pieces_and_the_collectives_number(helper):
    boxes = Mailboxes(_maps(2), OFFSET, CAPACITY, 0, _native(helper))
    x = torch.arange(10, dtype=torch.float64) - 2.5  # 80 B: 20 pieces
    boxes.bind(x).post(7)
    words = boxes.ll_boxes[1][0][:160].numpy().view(np.uint32)  # mailbox 1: 7 is odd
    assert (words[1::2] == 7).all()
    assert np.array_equal(words[0::2], x.numpy().view(np.uint32))


@needs_helper
def test_flagged_words_have_mailboxes_no_plain_payload_writes(helper):
    # a plain payload may hold any bit pattern, the number of a later collective among them: in a
    # mailbox the flagged words share, a peer could take it for a word already posted
    boxes = Mailboxes(_maps(2), OFFSET, CAPACITY, 0, _native(helper))
    bits = torch.full((256,), 9, dtype=torch.int32)  # collective 9's flag, in every 4 bytes
    for seq in (7, 8):
        boxes.bind(bits.view(torch.float32)).post(seq)  # 1 KiB: a plain mailbox
        boxes.bind(bits[:6].view(torch.float32)).post(seq)  # 24 B: the control line's slot
        boxes.bind(bits[:64].view(torch.bfloat16)).post(seq)  # 256 B, not C's: plain
    assert all(not bool(box.any()) for slot in boxes.ll_boxes for box in slot)


@needs_helper
def test_a_late_peer_hands_the_wait_to_the_python_policy(helper):
    """No peer arrives within the C spin: the wait policy takes over (here it times out and names
    the rank), rather than the helper waiting unbounded."""
    maps = _maps(2)
    ctl = Counters(maps, 0, timeout_s=0.05, wait="block")
    call = Mailboxes(maps, OFFSET, CAPACITY, 0, _native(helper, spin_ns=1000)).bind(torch.ones(3))
    with pytest.raises(RuntimeError, match="waited 0 s for rank 1 at collective #1"):
        call.run(ctl)


@needs_helper
def test_the_helpers_wait_alone_returns_once_every_peer_has_arrived(helper):
    """The in-place path's barriers wait through `wait_all` where ranks share CPUs: 0 once the
    peers' counters reach the collective, 1 when they do not within its spin or yields."""
    maps = _maps(2)
    peer = Counters(maps, 1, timeout_s=1, wait="block")
    for wait in (shm_native.Wait(spin_ns=1000), shm_native.Wait(yield_ns=1_000_000, slow_ns=10**12)):
        native = _native(helper)
        waiter = Mailboxes(maps, OFFSET, CAPACITY, 0, native).waiter(wait)
        seq = peer.seq + 1
        assert waiter.wait_all(waiter.plan, seq) == 1  # the peer has not arrived
        peer.arrive()
        assert waiter.wait_all(waiter.plan, seq) == 0
        assert wait.yielded == 0 and wait.slow == 0  # the peer was there at the first check


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """library() built afresh into an empty cache, its memo cleared before and after."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    shm_native.library.cache_clear()
    yield tmp_path / "dpscale"
    shm_native.library.cache_clear()


@pytest.mark.slow  # starts the compiler
def test_the_build_is_cached_per_user_and_reused(fresh_build):
    assert shm_native.library() is not None
    (built,) = list(fresh_build.glob("shm_small-*.so"))
    assert stat.S_IMODE(fresh_build.stat().st_mode) == 0o700
    first = built.stat().st_mtime_ns
    shm_native.library.cache_clear()
    assert shm_native.library() is not None
    assert built.stat().st_mtime_ns == first  # loaded, not rebuilt
    assert [p.name for p in fresh_build.iterdir()] == [built.name]  # no temp file left


@pytest.mark.slow  # starts the compiler
def test_without_the_interpreters_headers_the_helper_is_called_through_ctypes(fresh_build, monkeypatch):
    first = shm_native.library()
    assert first is not None
    if not first.module:
        pytest.skip("no Python.h here: the helper is called through ctypes already")
    shm_native.library.cache_clear()
    monkeypatch.setattr(shm_native.sysconfig, "get_paths", lambda: {"include": str(fresh_build / "none")})
    second = shm_native.library()
    assert second is not None and not second.module
    assert len(list(fresh_build.glob("shm_small-*.so"))) == 2  # each build cached under its own name


def test_no_compiler_means_the_python_path(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-dpscale")
    assert shm_native.library() is None


@pytest.mark.slow  # starts the "compiler"
def test_a_failed_build_means_the_python_path_and_leaves_nothing(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    assert shm_native.library() is None
    assert list(fresh_build.iterdir()) == []


def test_the_switch_turns_the_helper_off(fresh_build, monkeypatch):
    monkeypatch.setenv(shm_native.ENV_SWITCH, "0")
    assert shm_native.library() is None
    assert not fresh_build.exists()


def test_a_cache_others_can_write_to_is_not_loaded(fresh_build):
    fresh_build.mkdir(mode=0o700)
    os.chmod(fresh_build, 0o777)
    assert shm_native.library() is None


@needs_helper
def test_the_c_path_takes_floats_up_to_its_own_limit_and_other_dtypes_up_to_the_python_one(helper):
    maps = [mmap.mmap(-1, OFFSET + 2 * 4 * CAPACITY) for _ in range(2)]
    boxes = Mailboxes(maps, OFFSET, 4 * CAPACITY, 0, _native(helper), python_max_bytes=CAPACITY)
    assert boxes.fits(torch.zeros(CAPACITY, dtype=torch.float32))  # 4x the Python limit
    assert not boxes.fits(torch.zeros(CAPACITY + 1, dtype=torch.float32))
    assert boxes.fits(torch.zeros(CAPACITY // 2, dtype=torch.bfloat16))
    assert not boxes.fits(torch.zeros(CAPACITY // 2 + 1, dtype=torch.bfloat16))
    python = Mailboxes(maps, OFFSET, 4 * CAPACITY, 0, None, python_max_bytes=CAPACITY)
    assert not python.fits(torch.zeros(CAPACITY // 4 + 1, dtype=torch.float32))
