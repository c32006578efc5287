"""Which TCP ports a process listens on, and at which address: for tests of who can reach a job."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

_LISTEN = "0A"  # TCP state in /proc/net/tcp


def listening(pids: list[int]) -> list[str]:
    """host:port of every listening TCP socket these processes hold (from /proc, no `ss` needed).

    An address bound to every interface shows as 0.0.0.0 or ::.
    """
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
