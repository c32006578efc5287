"""Shared fixtures: every test must leave no dpscale shared-memory segment and no child process.

Test tiers: tests that start processes (spawned ranks, the CLI in a subprocess) carry the `slow`
marker; `make test-fast` runs the others with DPSCALE_TEST_NO_SPAWN=1, under which starting a
process fails the test with a message saying to mark it slow, so the fast tier stays honest.
"""

import multiprocessing as mp
import multiprocessing.process
import os
import subprocess
import time
from pathlib import Path

import pytest

NO_SPAWN = os.environ.get("DPSCALE_TEST_NO_SPAWN") == "1"

# --cpu-times FILE: each test's wall and CPU seconds (which slow tests mostly wait: marker `waits`)
pytest_plugins = ["support.cpu_times"]


def _segments() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if "dpscale" in n}
    except FileNotFoundError:
        return set()


def _semaphores() -> set[str]:
    """multiprocessing's named semaphores (the agent's queues for forked workers use them)."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("sem.mp-")}
    except FileNotFoundError:
        return set()


def _mapped(names: set[str], *, here: bool) -> set[str]:
    """Those of `names` that a live process maps (this one too only if `here`): in use, by the other
    lane of `make test` (slow tests run in two lanes side by side) or a run of its own."""
    used = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        if not here and maps.parent.name == str(os.getpid()):
            continue
        try:
            text = maps.read_text()
        except OSError:
            continue
        used |= {name for name in names if name in text}
    return used


def _left(listing, before: set[str], *, here: bool) -> set[str]:
    """What `listing()` shows now and not `before`, and nothing else uses: left behind. A resource
    tracker or a reaper that ends a job removes what it made within moments: look again for 2 s."""
    deadline = time.monotonic() + 2
    while True:
        new = listing() - before
        left = new - _mapped(new, here=here) if new else set()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@pytest.fixture(autouse=True)
def no_leaks(request):
    slow = request.node.get_closest_marker("slow") is not None
    before = _segments()
    semaphores = _semaphores() if slow else set()
    yield
    left = _left(_segments, before, here=False)  # a group this process left open
    assert not left, f"test left shared-memory segments behind: {sorted(left)}"
    if slow:  # only tests that start processes can leave one
        left = _left(_semaphores, semaphores, here=True)  # the lab harness's queues, alive
        assert not left, f"test left multiprocessing semaphores behind: {sorted(left)}"
    # the forkserver itself is shared by all tests; any other child is a leak
    children = [p for p in mp.active_children() if p.name.startswith("rank")]
    assert not children, f"test left processes running: {children}"


def _refuse_spawn(*args, **kwargs):
    raise RuntimeError(
        "this test (or a fixture it uses) starts a process, which the fast tier (make test-fast) "
        "does not allow: mark it @pytest.mark.slow (or the module with pytestmark = pytest.mark.slow)"
    )


_guard = pytest.MonkeyPatch()


def _fast(item) -> bool:
    return NO_SPAWN and item.get_closest_marker("slow") is None


# Hooks rather than a fixture: the guard must be on before any fixture of the test is set up
# (a module-scoped fixture that runs a bench starts processes too) and off after its teardown.
@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if _fast(item):
        _guard.setattr(multiprocessing.process.BaseProcess, "start", _refuse_spawn)
        _guard.setattr(subprocess.Popen, "__init__", _refuse_spawn)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    _guard.undo()
