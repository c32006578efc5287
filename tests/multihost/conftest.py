"""Emulated hosts: network namespaces joined by a bridge, for multi-host tests on one machine.

`hosts` gives two hosts, each a network namespace with one veth link (10.213.N.1 and 10.213.N.2,
N from the process id) to a bridge that lives in a third namespace, so nothing is added to the
machine's own network and nothing outside the namespaces is reachable. Needs root and `ip netns`;
skips with the reason where either is missing. Every process started on a host is killed and
every namespace (with its links) removed after the test, also when it fails.

The namespaces share the machine's host name and /dev/shm, so each host gets its own
DPSCALE_HOST_ID (what the transports take a host to be). GLOO_SOCKET_IFNAME is left unset on
purpose: the host name resolves to 127.0.0.1 here, and the workers must find the link themselves.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass, field

import pytest

IFNAME = "eth0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@dataclass
class Hosts:
    names: list[str]  # the namespaces, one per host
    addrs: list[str]  # each host's address on the link
    switch: str  # the namespace holding the bridge
    procs: list[subprocess.Popen] = field(default_factory=list)

    def env(self, i: int, **extra: str) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
        return {
            **base,
            "DPSCALE_HOST_ID": f"emulated-host-{i}",
            **extra,
        }

    def start(self, i: int, argv: list[str], **popen) -> subprocess.Popen:
        """Start `argv` on host `i` (in its own process group, so cleanup reaches its children)."""
        popen.setdefault("env", self.env(i))
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.names[i], *argv],
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **popen,
        )
        self.procs.append(proc)
        return proc

    def link(self, i: int, up: bool) -> None:
        """Cut (or restore) host i's link, as a pulled cable would."""
        _ip("-n", self.switch, "link", "set", f"p{i}", "up" if up else "down")


def _make(tag: str, count: int) -> Hosts:
    subnet = f"10.213.{os.getpid() % 250 + 1}"
    hosts = Hosts(
        [f"dps-{tag}-h{i}" for i in range(count)],
        [f"{subnet}.{i + 1}" for i in range(count)],
        f"dps-{tag}-sw",
    )
    _ip("netns", "add", hosts.switch)
    _ip("-n", hosts.switch, "link", "add", "br0", "type", "bridge")
    _ip("-n", hosts.switch, "link", "set", "br0", "up")
    for i, (ns, addr) in enumerate(zip(hosts.names, hosts.addrs, strict=True)):
        _ip("netns", "add", ns)
        # the pair is made in the switch namespace, then one end moves to the host under its own name
        _ip("-n", hosts.switch, "link", "add", f"p{i}", "type", "veth", "peer", "name", f"h{i}")
        _ip("-n", hosts.switch, "link", "set", f"h{i}", "netns", ns)
        _ip("-n", ns, "link", "set", f"h{i}", "name", IFNAME)
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME)
        _ip("-n", ns, "link", "set", IFNAME, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", hosts.switch, "link", "set", f"p{i}", "master", "br0")
        _ip("-n", hosts.switch, "link", "set", f"p{i}", "up")
    return hosts


def _remove(hosts: Hosts) -> None:
    for proc in hosts.procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)
    # deleting a namespace deletes the links in it (and the veth ends' peers)
    for ns in [*hosts.names, hosts.switch]:
        _ip("netns", "del", ns, check=False)


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "emulated hosts need root (ip netns add)"
    probe = f"dps-probe-{os.getpid()}"
    try:
        made = _ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return "emulated hosts need iproute2 (`ip` not found)"
    if made.returncode != 0:
        return f"ip netns is not permitted here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@pytest.fixture
def hosts():
    if reason := _why_not():
        pytest.skip(reason)
    tag = f"{os.getpid()}"
    made = None
    try:
        made = _make(tag, 2)
        yield made
    finally:
        if made is not None:
            _remove(made)
        else:  # a half-built set: remove whatever exists under this tag
            for ns in _ip("netns", "list").stdout.split():
                if ns.startswith(f"dps-{tag}-"):
                    _ip("netns", "del", ns, check=False)
