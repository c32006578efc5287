"""Who can reach a single-host job: every port its processes listen on is bound to 127.0.0.1.

Before, the agent's two rendezvous stores listened on every interface (`ss -ltnp` showed `*:PORT`
twice), unauthenticated: anyone on the network could join or disrupt the job.
"""

import ipaddress
import os
from pathlib import Path

import pytest

from conftest import TRAIN_NO_CHECKPOINTS, StderrWatch, kill_tagged, start_cli, tagged

pytestmark = pytest.mark.slow  # starts processes (spawned ranks or the CLI)

_LISTEN = "0A"  # TCP state in /proc/net/tcp


def _listening(pids: list[int]) -> list[str]:
    """host:port of every listening TCP socket these processes hold (from /proc, no `ss` needed)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == _LISTEN and inode in inodes:
                addr_hex, port_hex = local.split(":")
                # the kernel prints each 32-bit word in host (little-endian) order
                raw = b"".join(bytes.fromhex(addr_hex[i : i + 8])[::-1] for i in range(0, len(addr_hex), 8))
                found.append(f"{ipaddress.ip_address(raw[:width])}:{int(port_hex, 16)}")
    return found


def test_a_single_host_job_listens_on_loopback_only():
    run = [a if a != "30" else "100000" for a in TRAIN_NO_CHECKPOINTS] + ["--log-every", "5"]
    proc, tag = start_cli(run)
    try:
        StderrWatch(proc).wait_for("step 5/")
        ports = _listening(tagged(tag))
        # the rendezvous store and the agent store (launcher), gloo's sockets (workers)
        assert len(ports) >= 2, ports
        assert all(p.startswith("127.0.0.1:") for p in ports), ports
    finally:
        kill_tagged(tag)
        proc.wait()
