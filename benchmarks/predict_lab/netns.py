"""Emulated hosts on this machine: network namespaces joined by a bridge, optionally rate-limited.

Topology: a "switch" namespace holds a bridge; every emulated host is a namespace whose only
interface besides `lo`, eth0 (10.213.0.<i+1>/24), is a veth pair to a bridge port p<i>. With
`rate_gbit`, a token-bucket filter (`tc ... tbf`) caps both directions of every port: the host's
eth0 (upload) and its switch port (download), like a server's NIC on a switch. The addresses
exist only inside these namespaces (each set has its own bridge, so sets never see each other),
and no traffic leaves them.

One helper for both users: the prediction's emulated cluster (emulate.py) and the multi-host
tests (tests/multihost/conftest.py, which put benchmarks/ on sys.path as tests/lab/predict does).
Each names its namespaces with its own prefix.

Everything created here is deleted on exit, failure included: processes first (each started in
its own process group, which is killed whole), then the namespaces (which takes their
interfaces and queues with them). Names carry the creating process's id, so namespaces left by a
killed run are recognised and removed by the next one (`remove_stale`).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess

SUBNET = "10.213.0"  # private (RFC 1918); only ever configured inside our namespaces
IFNAME = "eth0"


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run `args` (e.g. "ip", "link", ...) in namespace `ns` (None: here); RuntimeError on failure."""
    cmd = ["ip", "netns", "exec", ns, *args] if ns else list(args)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    if check and out.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {out.stderr.strip() or out.stdout.strip()}")
    return out


def unavailable(prefix: str) -> str | None:
    """Why namespaces cannot be created here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (this process is not)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"{prefix}-{os.getpid()}-probe"
    out = ip("ip", "netns", "add", probe, check=False)
    if out.returncode != 0:
        return f"`ip netns add` fails here: {out.stderr.strip()}"
    ip("ip", "netns", "del", probe, check=False)
    return None


def remove_stale(prefix: str) -> list[str]:
    """Delete `prefix` namespaces whose creating process no longer exists; returns their names."""
    removed = []
    for line in ip("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == prefix and parts[1].isdigit() and not _alive(int(parts[1])):
            ip("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class EmulatedHosts:
    """Context manager: `count` host namespaces and their links up on enter, all torn down on exit."""

    def __init__(
        self,
        count: int,
        *,
        prefix: str,
        rate_gbit: float | None = None,
        burst_kb: int = 128,
        mtu: int | None = None,
    ):
        if count < 1:
            raise ValueError(f"count: at least 1 host, got {count}")
        tag = f"{prefix}-{os.getpid()}-{secrets.token_hex(2)}"
        self.switch = f"{tag}-sw"
        self.hosts = [f"{tag}-h{i}" for i in range(count)]
        self.rate_gbit = rate_gbit
        self.burst_kb = burst_kb
        self.mtu = mtu
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []

    @property
    def addrs(self) -> list[str]:
        return [self.address(i) for i in range(len(self.hosts))]

    def address(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def __enter__(self) -> EmulatedHosts:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        for ns in [self.switch, *self.hosts]:
            ip("ip", "netns", "add", ns)
            self._created.append(ns)
            ip("ip", "link", "set", "lo", "up", ns=ns)
        ip("ip", "link", "add", "br0", "type", "bridge", ns=self.switch)
        ip("ip", "link", "set", "br0", "up", ns=self.switch)
        mtu = ["mtu", str(self.mtu)] if self.mtu else []
        for i, host in enumerate(self.hosts):
            port = f"p{i}"
            ip(
                "ip",
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                IFNAME,
                "netns",
                host,
                ns=self.switch,
            )
            ip("ip", "link", "set", port, *mtu, "master", "br0", "up", ns=self.switch)
            ip("ip", "link", "set", IFNAME, *mtu, "up", ns=host)
            ip("ip", "addr", "add", f"{self.address(i)}/24", "dev", IFNAME, ns=host)
            if self.rate_gbit:
                rate = f"{self.rate_gbit * 1000:g}mbit"
                # queue limit as latency: deep enough that a full-rate TCP flow is shaped, not dropped
                tbf = ["tbf", "rate", rate, "burst", f"{self.burst_kb}kb", "latency", "100ms"]
                ip("tc", "qdisc", "add", "dev", IFNAME, "root", *tbf, ns=host)
                ip("tc", "qdisc", "add", "dev", port, "root", *tbf, ns=self.switch)

    def start(self, host: int, argv: list[str], **popen) -> subprocess.Popen:
        """Run `argv` inside host namespace `host` in its own process group (so cleanup reaches its
        children); `popen` goes to subprocess.Popen (env, stdout, stderr, text, ...)."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.hosts[host], *argv], start_new_session=True, **popen
        )
        self._procs.append(proc)
        return proc

    def link(self, host: int, up: bool) -> None:
        """Cut (or restore) host `host`'s link, as a pulled cable would."""
        ip("ip", "link", "set", f"p{host}", "up" if up else "down", ns=self.switch)

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        for ns in reversed(self._created):
            ip("ip", "netns", "del", ns, check=False)
        self._created.clear()
