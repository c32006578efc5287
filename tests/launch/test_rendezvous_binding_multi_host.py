"""Who can reach a multi-host job's stores: the addresses its user named, nothing else.

torch's c10d backend and its agent store listen on every interface whatever address they are
given. The `dpscale-c10d` handler binds the rendezvous store to the `--rdzv-endpoint` address and
the agent store to `--local-addr` (default: the address toward the endpoint). Here both are
loopback addresses other than 127.0.0.1 (every 127/8 address is on `lo`), so a store bound to the
wrong one, or to every interface, shows. The emulated-host test in tests/multihost/ checks a
whole two-host job with `ss`.
"""

import gc
import os
import uuid

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

from dpscale.comm.attempt import ROUND_ENV
from dpscale.launch import rendezvous
from support.sockets import listening


@pytest.fixture(autouse=True)
def no_round(monkeypatch):
    monkeypatch.delenv(ROUND_ENV, raising=False)


def _params(endpoint: str, local_addr: str | None, **config) -> RendezvousParameters:
    return RendezvousParameters(
        backend=rendezvous.MULTI_HOST_BACKEND,
        endpoint=endpoint,
        run_id=f"test-{uuid.uuid4().hex[:8]}",
        min_nodes=1,
        max_nodes=1,
        local_addr=local_addr,
        last_call_timeout=1,
        **config,
    )


def _new_listeners(params: RendezvousParameters) -> list[str]:
    """The sockets this process starts listening on while the handler serves one rendezvous."""
    gc.collect()  # free earlier handlers (reference cycles) now: a port freed mid-count hides a new one
    before = set(listening([os.getpid()]))
    handler = rendezvous_handler_registry.create_handler(params)
    try:
        handler.next_rendezvous()  # rank 0 of the round: it starts the agent store
        return sorted(set(listening([os.getpid()])) - before)
    finally:
        handler.shutdown()


def test_the_stores_listen_on_the_endpoint_and_the_local_address_only():
    found = _new_listeners(_params("127.0.0.2:0", "127.0.0.3", is_host=True))
    hosts = sorted(p.rpartition(":")[0] for p in found)
    assert hosts == ["127.0.0.2", "127.0.0.3"], found  # the rendezvous store, the agent store


def test_without_local_addr_the_agent_store_listens_where_the_endpoint_is_reached_from():
    # the route from this host to 127.0.0.2 leaves from 127.0.0.1 (lo's first address)
    found = _new_listeners(_params("127.0.0.2:0", None))  # is_host found by binding: 127.0.0.2 is ours
    hosts = sorted(p.rpartition(":")[0] for p in found)
    assert hosts == ["127.0.0.1", "127.0.0.2"], found


def test_is_host_on_a_host_without_the_endpoint_address_says_what_to_change():
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    # 192.0.2.1 (TEST-NET-1, RFC 5737) is on no interface here
    with pytest.raises(RendezvousConnectionError, match="is_host=0"):
        rendezvous_handler_registry.create_handler(_params("192.0.2.1:29400", "127.0.0.1", is_host=True))


def test_the_static_rendezvous_store_listens_on_the_endpoint_only():
    import socket

    with socket.socket() as s:  # a free port (a static endpoint names one)
        s.bind(("127.0.0.2", 0))
        port = s.getsockname()[1]
    params = RendezvousParameters(
        backend=rendezvous.register_static(),
        endpoint=f"127.0.0.2:{port}",
        run_id=f"test-{uuid.uuid4().hex[:8]}",
        min_nodes=1,
        max_nodes=1,
        rank=0,
    )
    gc.collect()
    before = set(listening([os.getpid()]))
    handler = rendezvous_handler_registry.create_handler(params)
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    assert sorted(set(listening([os.getpid()])) - before) == [f"127.0.0.2:{port}"]  # torch's: *:port


def test_a_read_timeout_that_is_not_positive_is_bad_input():
    # ConfigError: the CLI shows one line (exit 2) instead of a traceback
    from dpscale.errors import ConfigError

    with pytest.raises(ConfigError, match="read_timeout must be a positive number of seconds, got 0"):
        rendezvous_handler_registry.create_handler(_params("127.0.0.2:0", "127.0.0.2", read_timeout="0"))
