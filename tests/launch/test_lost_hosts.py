"""Naming the hosts a multi-host job lost: on a cut-off host, every host it cannot reach; after a
failure, the hosts that did not rejoin within the bounded wait (not torch's 600 s).

Both rendezvous handlers run in this process on loopback addresses (127.0.0.5 serves the store,
127.0.0.6 is the other host). A host behind a pulled cable is a listening socket on 127.0.0.7
whose backlog is full: the kernel drops further connects, so they go unanswered, as across a cut
link.
"""

import contextlib
import gc
import re
import socket
import threading
import time
import uuid

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

from dpscale.comm.attempt import ROUND_ENV
from dpscale.launch import lost_hosts, rendezvous
from dpscale.launch.lost_hosts import HostTable, answers, silent
from support.timing import cpu_baseline_s

GONE = "127.0.0.7"


@pytest.fixture(autouse=True)
def no_round(monkeypatch):
    monkeypatch.delenv(ROUND_ENV, raising=False)
    yield
    # a handler holds its stores' listening sockets in reference cycles (its wrapped methods): free
    # them once the test's frames are gone, so no later test meets them or their ports
    gc.collect()


def _closed_port(addr: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]  # nothing listens once closed: a connect is refused


@contextlib.contextmanager
def _gone_host():
    """A port on GONE that never answers a connect (see the module docstring); yields the port."""
    with contextlib.ExitStack() as stack:
        listener = stack.enter_context(socket.socket())
        listener.bind((GONE, 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        for _ in range(3):  # fill the backlog; these connects are never accepted
            client = stack.enter_context(socket.socket())
            client.setblocking(False)
            client.connect_ex((GONE, port))
        time.sleep(0.1)
        yield port


def test_a_refused_connect_is_a_live_host_and_silence_a_lost_one():
    with _gone_host() as port:
        assert answers("127.0.0.1", port, 0.5)  # nothing listens there: refused, so alive
        assert not answers(GONE, port, 0.5)
        assert silent(["127.0.0.1", GONE, "127.0.0.6"], port, 0.5) == [GONE]


def test_the_hosts_are_probed_all_at_once(monkeypatch):
    # each probe returns only once every probe has started: probes one after another would break
    # the barrier (no clock read: a loaded machine cannot fail this, a serial loop always does)
    addrs = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    barrier = threading.Barrier(len(addrs), timeout=10)

    def probe(addr, port, timeout_s):
        barrier.wait()
        return addr != "10.0.0.2"

    monkeypatch.setattr(lost_hosts, "answers", probe)
    assert silent(addrs, 29400, timeout_s=10) == ["10.0.0.2"]
    assert not barrier.broken


class _SilentStore:
    def __init__(self):
        self.release = threading.Event()

    def compare_set(self, *args):
        self.release.wait(60)  # no answer, no reset: a pulled cable
        return b""

    get = compare_set


def test_a_cut_off_host_names_every_host_it_cannot_reach():
    store = _SilentStore()
    with _gone_host() as port:
        hosts = HostTable("127.0.0.1", port)
        hosts.this_host, hosts.peers = "127.0.0.9", ["127.0.0.1", GONE]  # as after a completed round
        try:
            with pytest.raises(rendezvous.HostsLost) as e:
                rendezvous._MultiHostBackend(store, "job", 1, f"127.0.0.1:{port}", hosts)
        finally:
            store.release.set()
    # the store's host answers (refused), so only the other one is lost
    assert str(e.value).startswith(f"lost host {GONE}: the rendezvous store at 127.0.0.1:{port} did not"), e


def _handler(port: int, local_addr: str, **config):
    params = RendezvousParameters(
        backend=rendezvous.MULTI_HOST_BACKEND,
        endpoint=f"127.0.0.5:{port}",
        run_id=RUN_ID,
        min_nodes=2,
        max_nodes=2,
        local_addr=local_addr,
        read_timeout=5,
        close_timeout=1,
        **config,
    )
    return rendezvous_handler_registry.create_handler(params)


RUN_ID = f"test-{uuid.uuid4().hex[:8]}"


def test_after_a_failure_the_hosts_that_do_not_rejoin_are_named_within_the_rejoin_timeout():
    port = _closed_port("127.0.0.5")
    store_host = _handler(port, "127.0.0.5", is_host=True, rejoin_timeout=1)
    other = _handler(port, "127.0.0.6", is_host=False)
    try:
        joined = threading.Thread(target=other.next_rendezvous, daemon=True)
        joined.start()
        store_host.next_rendezvous()  # round 0: both hosts
        joined.join(30)
        # the store's host restarts after a failure; the other host never comes back
        slack_s = 300 * cpu_baseline_s()
        start = time.monotonic()
        # named as the host published itself before joining (both are this machine here)
        waited = "^" + re.escape(f"lost host {socket.gethostname()} (127.0.0.6): the job waited 1 s")
        with pytest.raises(rendezvous.HostsDidNotRejoin, match=waited):
            store_host.next_rendezvous()
        assert time.monotonic() - start < 1 + 5 + slack_s  # 1 s, plus torch's 5 s to leave the round
    finally:
        for handler in (other, store_host):
            handler.shutdown()


def test_hosts_are_named_as_they_published_themselves_and_a_missing_name_costs_no_wait():
    import torch.distributed as dist

    store = dist.HashStore()
    hosts = HostTable("10.0.0.1", 29400)
    hosts.peers = ["10.0.0.1", "10.0.0.3"]
    hosts.publish_name(store, "job", "10.0.0.1", 5)
    slack_s = 100 * cpu_baseline_s()  # ~1 s quiet; a wait would take the whole minute
    start = time.monotonic()
    hosts.read_names(store, "job", 60)  # 10.0.0.3 never published: no names, and no wait
    assert hosts.hostnames == {} and time.monotonic() - start < slack_s
    assert (
        hosts.describe(["10.0.0.1", "10.0.0.3"])
        == "lost hosts 10.0.0.1 (serves the rendezvous store), 10.0.0.3"
    )
    store.set("dpscale/hostname/job/10.0.0.3", "node-03")
    hosts.read_names(store, "job", 5)
    me = socket.gethostname()
    assert hosts.describe(["10.0.0.1", "10.0.0.3"]) == (
        f"lost hosts {me} (10.0.0.1, serves the rendezvous store), node-03 (10.0.0.3)"
    )
