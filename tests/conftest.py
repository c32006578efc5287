"""Shared fixtures: every test must leave no dpscale shared-memory segment and no child process."""

import multiprocessing as mp
import os

import pytest


def _segments() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if "dpscale" in n}
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True)
def no_leaks():
    before = _segments()
    yield
    left = _segments() - before
    assert not left, f"test left shared-memory segments behind: {sorted(left)}"
    # the forkserver itself is shared by all tests; any other child is a leak
    children = [p for p in mp.active_children() if p.name.startswith("rank")]
    assert not children, f"test left processes running: {children}"
