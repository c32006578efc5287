"""Which hosts a multi-host job lost: the rendezvous' host table, a reachability probe, the wording.

The table is what the `dpscale-c10d` rendezvous collected when the job started: every host of the
last completed round, by the address it gave (`--local-addr`, or its address toward the endpoint;
rendezvous.py always sets one). Two questions are answered from it:

- on a host cut off from the store: which of the others it can no longer reach. A TCP connect to
  each host's endpoint port, all at once under one deadline: an answer (accepted, or refused
  because nothing listens there) means the host is reachable, silence or "no route" means it is
  lost. A firewall that drops rather than refuses makes a live host look lost; the message says
  the hosts did not answer, nothing more.
- on a host whose job waited for the others to rejoin after a failure: which hosts of the last
  round did not come back.
"""

from __future__ import annotations

import socket
import threading

from dpscale.comm.attempt import within
from dpscale.launch import torch_private

PROBE_S = 2.0
"""How long a probe waits for each host: a connect across a working link is answered in far less
than the 1 s after which TCP resends its first SYN."""


def answers(addr: str, port: int, timeout_s: float = PROBE_S) -> bool:
    """Whether `addr` answers a TCP connect to `port` within `timeout_s` (refused counts: only a
    live host refuses)."""
    try:
        with socket.create_connection((addr, port), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return True
    except OSError:  # timed out, no route, host unreachable
        return False


def silent(addrs: list[str], port: int, timeout_s: float = PROBE_S) -> list[str]:
    """The addresses among `addrs` that do not answer (probed in parallel: one deadline in all)."""
    answered: dict[str, bool] = {}

    def probe(addr: str) -> None:
        answered[addr] = answers(addr, port, timeout_s)

    threads = [threading.Thread(target=probe, args=(a,), daemon=True) for a in addrs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 1)
    return [a for a in addrs if not answered.get(a, False)]


class HostTable:
    """The hosts of a multi-host job as this host's rendezvous handler last saw them."""

    def __init__(self, endpoint_host: str, endpoint_port: int):
        self.endpoint_host = endpoint_host
        self.endpoint_port = endpoint_port
        self.this_host: str | None = None
        self.peers: list[str] = []
        """The other hosts of the last completed round, by address."""
        self.round: int | None = None
        self.hostnames: dict[str, str] = {}
        """Each host's name by address, as it published it (best effort: may be empty)."""
        self._back: set[str] = set()

    def publish_name(self, store, run_id: str, addr: str, timeout_s: float) -> None:
        """Put this host's name in the rendezvous store before it joins (best effort)."""
        within(timeout_s, lambda: store.set(_name_key(run_id, addr), socket.gethostname()), None)

    def read_names(self, store, run_id: str, timeout_s: float) -> None:
        """After a completed round: the names every other host published before it joined."""
        keys = [_name_key(run_id, addr) for addr in self.peers]
        # check first: a get waits for a missing key (a host that could not publish) up to timeout_s
        if not keys or not within(timeout_s, lambda: store.check(keys), False):
            return
        names = within(timeout_s, lambda: store.multi_get(keys), None)
        if names:
            self.hostnames = {addr: name.decode() for addr, name in zip(self.peers, names, strict=True)}

    def record(self, handler) -> None:
        """After a completed round: who took part (torch's DynamicRendezvousHandler, private state
        read through torch_private.py; tests/launch/test_lost_hosts.py fails if a release moves it)."""
        self.this_host, members, self.round = torch_private.round_members(handler)
        self.peers = sorted(set(members) - {self.this_host})
        self._back = set()

    def observe(self, state) -> None:
        """Note who came back for the next round, from every rendezvous state this host reads.

        Cumulative, because a host that gives up waiting leaves the wait list again (torch's
        rollback): it was back, not lost."""
        if self.round is None or state is None:
            return
        if state.complete and state.round == self.round:  # the old round: rejoining hosts wait
            nodes = set(state.wait_list)
        elif state.round > self.round:
            nodes = set(state.participants) | set(state.wait_list)
        else:
            return
        self._back |= {node.addr for node in nodes}

    def not_rejoined(self) -> list[str]:
        """The hosts of the last completed round not seen back since."""
        return sorted(set(self.peers) - self._back)

    def name(self, addr: str) -> str:
        """ "node-01 (10.0.0.1, serves the rendezvous store)", "node-02 (10.0.0.2)", or the address
        alone (and its role) where the host's name is not known."""
        where = [addr, "serves the rendezvous store"] if addr == self.endpoint_host else [addr]
        if host := self.hostnames.get(addr):
            return f"{host} ({', '.join(where)})"
        return f"{addr} ({where[1]})" if len(where) > 1 else addr

    def unreachable(self) -> list[str]:
        """The hosts (the store's included) that do not answer a probe now."""
        others = sorted((set(self.peers) | {self.endpoint_host}) - {self.this_host})
        return silent(others, self.endpoint_port)

    def describe(self, addrs: list[str]) -> str:
        """ "lost host node-02 (10.0.0.2)" / "lost hosts node-01 (10.0.0.1, serves the rendezvous
        store), node-03 (10.0.0.3)"."""
        return f"lost host{'s' if len(addrs) > 1 else ''} " + ", ".join(self.name(a) for a in addrs)


def _name_key(run_id: str, addr: str) -> str:
    return f"dpscale/hostname/{run_id}/{addr}"
