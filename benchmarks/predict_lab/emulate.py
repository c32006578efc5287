"""An emulated multi-host cluster on this machine: network namespaces joined by rate-limited links.

Topology: a "switch" namespace holds a bridge; every emulated host is a namespace whose only
interface, eth0 (10.213.0.<i+1>/24, jumbo frames), is a veth pair to a bridge port. A token-bucket
filter (`tc ... tbf rate R`) caps both directions of every port: the host's eth0 (upload) and its
switch port (download), so each host has a full-duplex link of R, like a server's NIC on a switch.
The addresses exist only inside these namespaces, so no traffic leaves them.

Workers run under torchrun, one torchrun per host namespace (`ip netns exec`), with the c10d
rendezvous on the first host's address; DPSCALE_HOST_ID tells dpscale which host a worker is on
(the namespaces share the real host name). emulate_worker.py is what each worker runs.

Everything created here is deleted on exit, failure included: processes first (their process
groups), then the namespaces (which takes their interfaces and queues with them). Names carry this
process's id, so namespaces left by a killed run are recognised and removed by the next one.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

SUBNET = "10.213.0"  # private (RFC 1918); only ever configured inside our namespaces
PREFIX = "dpsemu"
# A fresh namespace has no other listener, so a fixed port cannot collide with anything.
RDZV_PORT = 29400
MTU = 9000  # jumbo frames: TCP/IP headers cost < 1% of the rate instead of ~4% at 1500


@dataclass(frozen=True, kw_only=True)
class EmulationConfig:
    hosts: int = 2  # emulated hosts (namespaces)
    workers_per_host: int = 1
    rate_gbit: float = 1.0  # each host's link, per direction
    burst_kb: int = 128  # token bucket depth: >= one 64 KiB GSO packet, ~1 ms at 1 Gbit/s
    model: str = "mlp"  # built-in workload trained for a few steps
    per_worker_batch: int = 16
    steps: int = 4
    warmup: int = 2
    sizes_bytes: list[int] = field(default_factory=lambda: [4 << 20, 16 << 20])  # all-reduce timings
    iters: int = 3
    transport: str = "gloo"  # dpscale transport in training: gloo, or auto (hierarchical across hosts)
    timeout_s: float = 240.0

    def __post_init__(self) -> None:
        if self.hosts < 2:
            raise ValueError(f"hosts: an emulated cluster needs >= 2 hosts, got {self.hosts}")
        if self.workers_per_host < 1 or self.steps < 1 or self.iters < 1 or self.warmup < 0:
            raise ValueError("workers_per_host, steps and iters must be >= 1, warmup >= 0")
        if not self.rate_gbit > 0:
            raise ValueError(f"rate_gbit: must be > 0, got {self.rate_gbit}")
        if self.transport not in ("gloo", "auto"):
            raise ValueError(f"transport: gloo or auto, got {self.transport!r}")


@dataclass(frozen=True)
class EmulationResult:
    config: EmulationConfig
    allreduce: list[dict]  # [{"bytes": int, "time_us": float}]: median of the slowest rank per size
    local_step_ms: float  # bare model, every worker computing at once (no communication)
    train_step_ms: float  # dpscale engine, median over steps of the slowest rank
    train_comm_ms: float | None
    transport: str

    def to_dict(self) -> dict:
        return asdict(self)


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", "netns", "exec", ns, *args] if ns else list(args)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    if check and out.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {out.stderr.strip() or out.stdout.strip()}")
    return out


def unavailable() -> str | None:
    """Why namespaces cannot be created here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (this process is not)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    out = _ip("ip", "netns", "add", probe, check=False)
    if out.returncode != 0:
        return f"`ip netns add` fails here: {out.stderr.strip()}"
    _ip("ip", "netns", "del", probe, check=False)
    return None


def remove_stale() -> list[str]:
    """Delete namespaces left by emulations whose process no longer exists; returns their names."""
    out = _ip("ip", "netns", "list", check=False)
    removed = []
    for line in out.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit() and not _alive(int(parts[1])):
            _ip("ip", "netns", "del", name, check=False)
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


class EmulatedCluster:
    """Context manager: namespaces and links up on enter, everything torn down on exit."""

    def __init__(self, config: EmulationConfig):
        self.config = config
        tag = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(2)}"
        self.switch = f"{tag}-sw"
        self.hosts = [f"{tag}-h{i}" for i in range(config.hosts)]
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []

    def address(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def __enter__(self) -> EmulatedCluster:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        c = self.config
        rate = f"{c.rate_gbit * 1000:g}mbit"
        # queue limit as latency: deep enough that a full-rate TCP flow is shaped, not dropped
        tbf = ["tbf", "rate", rate, "burst", f"{c.burst_kb}kb", "latency", "100ms"]
        for ns in [self.switch, *self.hosts]:
            _ip("ip", "netns", "add", ns)
            self._created.append(ns)
            _ip("ip", "link", "set", "lo", "up", ns=ns)
        _ip("ip", "link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("ip", "link", "set", "br0", "up", ns=self.switch)
        for i, host in enumerate(self.hosts):
            port = f"p{i}"
            _ip(
                "ip",
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                host,
                ns=self.switch,
            )
            _ip("ip", "link", "set", port, "mtu", str(MTU), "master", "br0", "up", ns=self.switch)
            _ip("ip", "link", "set", "eth0", "mtu", str(MTU), "up", ns=host)
            _ip("ip", "addr", "add", f"{self.address(i)}/24", "dev", "eth0", ns=host)
            _ip("tc", "qdisc", "add", "dev", "eth0", "root", *tbf, ns=host)
            _ip("tc", "qdisc", "add", "dev", port, "root", *tbf, ns=self.switch)

    def start(self, host: int, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        """Run `argv` inside host namespace `host`, in its own process group; output to `log`.out/.err.

        Files, not pipes: a chatty process blocks on a full pipe nobody is reading yet.
        """
        with open(log.with_suffix(".out"), "w") as out, open(log.with_suffix(".err"), "w") as err:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.hosts[host], *argv],
                env={**os.environ, **env},
                stdout=out,
                stderr=err,
                start_new_session=True,  # one process group per host: torchrun and its workers
            )
        self._procs.append(proc)
        return proc

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
            _ip("ip", "netns", "del", ns, check=False)
        self._created.clear()


def _torchrun(cluster: EmulatedCluster, host: int, config: EmulationConfig, run_id: str) -> list[str]:
    worker_config = json.dumps(
        {
            "model": config.model,
            "per_worker_batch": config.per_worker_batch,
            "steps": config.steps,
            "warmup": config.warmup,
            "sizes_bytes": config.sizes_bytes,
            "iters": config.iters,
            "transport": config.transport,
        }
    )
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={config.hosts}",
        f"--nproc-per-node={config.workers_per_host}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={cluster.address(0)}:{RDZV_PORT}",
        f"--rdzv-id={run_id}",
        # the first host serves the store; torchrun cannot tell by name (all hosts share one)
        f"--rdzv-conf=is_host={int(host == 0)}",
        f"--local-addr={cluster.address(host)}",
        "--max-restarts=0",
        # a script path, not a module: the validation code lives beside the benchmarks, outside the package
        str(Path(__file__).with_name("emulate_worker.py")),
        worker_config,
    ]


def _wait(procs: list[subprocess.Popen], logs: list[Path], timeout_s: float) -> None:
    """Until every host is done; the first failure (the others would wait for it) or a timeout raises."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        for i, code in enumerate(codes):
            if code not in (None, 0):
                err = logs[i].with_suffix(".err").read_text()
                raise RuntimeError(f"emulated host {i} failed (exit {code}):\n{err[-4000:]}")
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            waiting = [i for i, code in enumerate(codes) if code is None]
            raise RuntimeError(f"emulated hosts {waiting} did not finish in {timeout_s:.0f} s")
        time.sleep(0.1)


def run(config: EmulationConfig) -> EmulationResult:
    """Build the cluster, run the workers on it, tear it down; returns rank 0's measurements."""
    if why := unavailable():
        raise RuntimeError(f"cannot emulate a cluster: {why}")
    remove_stale()
    with tempfile.TemporaryDirectory(prefix="dpscale-emulate-") as logdir, EmulatedCluster(config) as cluster:
        run_id = secrets.token_hex(4)
        logs = [Path(logdir) / f"host{i}" for i in range(config.hosts)]
        procs = []
        for i in range(config.hosts):
            env = {
                "DPSCALE_HOST_ID": f"emulated-host-{i}",
                "GLOO_SOCKET_IFNAME": "eth0",  # the shaped link, never lo
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
            }
            procs.append(cluster.start(i, _torchrun(cluster, i, config, run_id), env, logs[i]))
        _wait(procs, logs, config.timeout_s)
        outputs = [log.with_suffix(".out").read_text() for log in logs]
    lines = [ln for out in outputs for ln in out.splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError("no worker printed its result line")
    doc = json.loads(lines[-1])
    return EmulationResult(
        config=config,
        allreduce=doc["allreduce"],
        local_step_ms=doc["local_step_ms"],
        train_step_ms=doc["train_step_ms"],
        train_comm_ms=doc.get("train_comm_ms"),
        transport=doc["transport"],
    )
