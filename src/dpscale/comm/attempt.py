"""Which attempt of an elastic job this worker belongs to, and which host each rank runs on.

Keys dpscale puts in the agent's store must be unique per attempt: the store outlives a restart
and still holds the previous attempt's gloo addresses and failure reports. The key must also be
the same on every host of one attempt. `TORCHELASTIC_RESTART_COUNT` is not: it counts the
restarts of this host's agent only. When a worker on host A fails, A's agent counts a restart,
but host B's agent restarts its workers because the group changed and keeps its old count; the
ranks then wait on different keys until they time out. What every host shares for one attempt
is the rendezvous round. torch does not hand it to workers, so dpscale's rendezvous handlers
(launch/rendezvous.py) export it as `DPSCALE_RDZV_ROUND` before the agent starts its workers.
Under another rendezvous backend (plain `torchrun --rdzv-backend c10d`) only the restart count
is known: correct on one host, not across hosts (docs/fault-tolerance.md says which to use).

Each rank also publishes its host name and address at start-up, so that an error about a rank
that went silent can say where it ran ("rank 9 on host node-03 (10.0.0.7)").
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import threading
from collections.abc import Callable
from typing import TypeVar

ROUND_ENV = "DPSCALE_RDZV_ROUND"
_T = TypeVar("_T")


def attempt_id() -> str:
    """A name for this attempt, equal on every host of it: the rendezvous round when dpscale's
    handler exported it, else this host's restart count (right on one host only)."""
    rdzv_round = os.environ.get(ROUND_ENV)
    if rdzv_round is not None:
        return f"round_{int(rdzv_round)}"
    return f"attempt_{int(os.environ.get('TORCHELASTIC_RESTART_COUNT', '0'))}"


def is_restart() -> bool:
    """Whether an earlier attempt of this job ran (then the workers resume from its checkpoint).

    On every host: a healthy host restarted because another one failed has a restart count of 0
    but a later rendezvous round.
    """
    rdzv_round = int(os.environ.get(ROUND_ENV, "0"))
    return rdzv_round > 0 or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def host_key(rank: int) -> str:
    return f"dpscale/{attempt_id()}/host/{rank}"


def source_address(peer_addr: str) -> str | None:
    """The address this host reaches `peer_addr` from (the one the other hosts see), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer_addr, 9))  # UDP connect sends nothing; it only picks a route
            return s.getsockname()[0]
    except OSError:
        return None


def this_host(peer_addr: str | None = None) -> dict[str, str]:
    """{"host": hostname, "addr": the address this host reaches `peer_addr` from (or its name's)}."""
    name = socket.gethostname()
    addr = source_address(peer_addr) if peer_addr else None
    if not addr:
        try:
            addr = socket.gethostbyname(name)
        except OSError:
            addr = "?"
    return {"host": name, "addr": addr}


def interface_toward(peer_addr: str) -> str | None:
    """The name of this host's interface that carries the route to `peer_addr` (None if unknown)."""
    import fcntl
    import struct

    source = this_host(peer_addr)["addr"]
    for _, name in socket.if_nameindex():
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                packed = struct.pack("256s", name.encode()[:15])
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, packed)[20:24])  # SIOCGIFADDR
        except OSError:  # no IPv4 address on it
            continue
        if addr == source:
            return name
    return None


def gloo_interface_hint(peer_addr: str | None) -> str | None:
    """The interface gloo should use, where its own guess would be loopback: None when
    GLOO_SOCKET_IFNAME is set, the store is on this host's loopback, or the host name resolves
    to a routable address (gloo then finds the right interface itself)."""
    if os.environ.get("GLOO_SOCKET_IFNAME") or not peer_addr:
        return None
    try:
        if ipaddress.ip_address(socket.gethostbyname(peer_addr)).is_loopback:
            return None
        if not ipaddress.ip_address(socket.gethostbyname(socket.gethostname())).is_loopback:
            return None
    except (OSError, ValueError):
        pass  # the host name does not resolve: gloo cannot use it either
    return interface_toward(peer_addr)


def describe_rank(rank: int, host: dict[str, str] | None) -> str:
    """ "rank 9 on host node-03 (10.0.0.7)", or "rank 9" when its host is not known."""
    if not host:
        return f"rank {rank}"
    return f"rank {rank} on host {host.get('host', '?')} ({host.get('addr', '?')})"


def publish_host(store, rank: int, peer_addr: str | None = None) -> None:
    """Put this rank's host in the store (one set; nobody waits for it)."""
    store.set(host_key(rank), json.dumps(this_host(peer_addr)))


def within(deadline_s: float, call: Callable[[], _T], default: _T) -> _T:
    """`call()`, or `default` when it has not returned (or raised) within `deadline_s`."""
    try:
        return bounded(deadline_s, call)
    except Exception:  # the store is gone: the same as no answer
        return default


def bounded(deadline_s: float, call: Callable[[], _T]) -> _T:
    """`call()`'s result or exception; TimeoutError when it has not returned within `deadline_s`.

    A store client blocks in the kernel when the store's host is cut off (no reset ever comes), and
    its own timeout does not cover every call (`check`, `set`, `compare_set` wait in a plain
    `recv`); a daemon thread bounds it. The thread may stay blocked; it dies with the process.
    """
    box: list = []

    def run() -> None:
        try:
            box.append((True, call()))
        except BaseException as e:
            box.append((False, e))

    thread = threading.Thread(target=run, daemon=True, name="dpscale-store-call")
    thread.start()
    thread.join(deadline_s)
    if not box:
        raise TimeoutError(f"no answer within {deadline_s:g} s")
    ok, value = box[0]
    if not ok:
        raise value
    return value
