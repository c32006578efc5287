"""Emulated hosts for the multi-host tests: benchmarks/predict_lab/netns.py's network namespaces.

`hosts` gives two hosts (`three_hosts` three), each a network namespace with one veth link
(10.213.0.1, 10.213.0.2, ...) to a bridge in a namespace of its own, so nothing is added to the
machine's own network and nothing outside the namespaces is reachable. Needs root and `ip netns`;
skips with the reason where either is missing. Every process started on a host is killed and
every namespace (with its links) removed after the test, also when it fails. The names start
with "dpsmh" (the prediction's emulated cluster uses "dpsemu").

The namespaces share the machine's host name and /dev/shm, so each host gets its own
DPSCALE_HOST_ID (what the transports take a host to be). GLOO_SOCKET_IFNAME is left unset on
purpose: the host name resolves to 127.0.0.1 here, and the workers must find the link themselves.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from predict_lab.netns import EmulatedHosts, remove_stale, unavailable  # noqa: E402

PREFIX = "dpsmh"


class Hosts(EmulatedHosts):
    """Emulated hosts; `start` pipes the output (text) and gives each host its own host id."""

    @property
    def names(self) -> list[str]:
        return self.hosts

    def env(self, i: int, **extra: str) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
        return {**base, "DPSCALE_HOST_ID": f"emulated-host-{i}", **extra}

    def start(self, i: int, argv: list[str], **popen) -> subprocess.Popen:
        popen.setdefault("env", self.env(i))
        popen.setdefault("stdout", subprocess.PIPE)
        popen.setdefault("stderr", subprocess.PIPE)
        popen.setdefault("text", True)
        return super().start(i, argv, **popen)


def _hosts(count: int):
    if reason := unavailable(PREFIX):
        pytest.skip(f"emulated hosts: {reason}")
    remove_stale(PREFIX)  # left by a run that was killed before its cleanup
    with Hosts(count, prefix=PREFIX) as made:
        yield made


def pytest_collection_modifyitems(items):
    # one set of emulated hosts at a time (make test runs two xdist workers): each set is three or
    # four processes per host, which two at once on a 2-core host would starve past the tests' bounds
    for item in items:
        if Path(__file__).parent in item.path.parents:
            item.add_marker(pytest.mark.xdist_group("emulated-hosts"))


@pytest.fixture
def hosts():
    yield from _hosts(2)


@pytest.fixture
def three_hosts():
    """Three hosts (10.213.0.1-3), for what two cannot show: which of several hosts was lost."""
    yield from _hosts(3)
