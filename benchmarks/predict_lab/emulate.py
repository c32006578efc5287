"""An emulated multi-host cluster on this machine: network namespaces joined by rate-limited links.

The hosts are netns.EmulatedHosts (a bridge, one namespace per host, eth0 at 10.213.0.<i+1>, a
token bucket of `rate_gbit` on both directions of every link) with jumbo frames. Workers run
under torchrun, one torchrun per host namespace (`ip netns exec`), with the c10d rendezvous on the
first host's address; DPSCALE_HOST_ID tells dpscale which host a worker is on (the namespaces
share the real host name). emulate_worker.py is what each worker runs. Everything is deleted on
exit, failure included (see netns.py).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from predict_lab import netns

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


def unavailable() -> str | None:
    """Why namespaces cannot be created here, or None when they can."""
    return netns.unavailable(PREFIX)


def remove_stale() -> list[str]:
    """Delete namespaces left by emulations whose process no longer exists; returns their names."""
    return netns.remove_stale(PREFIX)


class EmulatedCluster(netns.EmulatedHosts):
    """Context manager: the config's hosts and rate-limited links up on enter, torn down on exit."""

    def __init__(self, config: EmulationConfig):
        super().__init__(
            config.hosts, prefix=PREFIX, rate_gbit=config.rate_gbit, burst_kb=config.burst_kb, mtu=MTU
        )
        self.config = config

    def start(self, host: int, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        """Run `argv` on host `host`; output to `log`.out/.err.

        Files, not pipes: a chatty process blocks on a full pipe nobody is reading yet.
        """
        with open(log.with_suffix(".out"), "w") as out, open(log.with_suffix(".err"), "w") as err:
            return super().start(host, argv, env={**os.environ, **env}, stdout=out, stderr=err)


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
