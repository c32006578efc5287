"""The rendezvous of a single-host job, reachable from this host only.

torch's stores (`TCPStore`) have no authentication, and a store server listens on every interface
whatever host name it is given: anyone who can reach the port can join or disrupt the job. For a
job on one host the launcher therefore creates both of the agent's store servers itself, on
sockets bound to 127.0.0.1, and hands them to torch (`master_listen_fd`):

- the rendezvous store (torch's c10d rendezvous backend holds its state there), and
- the agent store the workers' process group meets in (TORCHELASTIC_USE_AGENT_STORE), which
  torch's handler would create on a port of its own, on every interface (torch_private.py).

A multi-host job (`dpscale train --nnodes`, or torchrun on each host with the `dpscale-c10d`
backend: torch's c10d, registered for torchrun through the `torchrun.handlers` entry point,
torchrun_plugin.py) binds what its user names, nothing else: the rendezvous store listens on the
`--rdzv-endpoint` address of the host that serves it, the agent store on `--local-addr` (default:
this host's address toward the endpoint, which is then also what the other hosts are told).
Like every handler here it tells the workers the rendezvous round (`DPSCALE_RDZV_ROUND`), the
one attempt number all hosts share (comm/attempt.py). It also keeps the host table of the last
round, so that a host that loses the others can name them (lost_hosts.py), and after a failure
waits for the hosts to rejoin only as long as `rejoin_timeout` says (nodes.py), not torch's 600 s.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

from dpscale.comm.attempt import ROUND_ENV, bounded, source_address
from dpscale.errors import ConfigError
from dpscale.launch import torch_private
from dpscale.launch.lost_hosts import PROBE_S, HostTable
from dpscale.launch.nodes import REJOIN_TIMEOUT, carries_address

BACKEND = "dpscale-loopback"
MULTI_HOST_BACKEND = "dpscale-c10d"
STATIC_BACKEND = "dpscale-static"
LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 29400  # torchrun's, for an endpoint given without one


class HostsLost(RendezvousConnectionError):
    """This host cannot reach the rendezvous store; the message names the hosts it lost."""


class HostsDidNotRejoin(RendezvousTimeoutError):
    """After a failure, too few hosts came back in time; the message names the missing ones."""


def loopback_store(port: int = 0) -> dist.TCPStore:
    """A store server listening on 127.0.0.1 only (port 0: one the OS picks)."""
    return bound_store(LOOPBACK, port)


def bound_store(
    host: str, port: int = 0, timeout_s: float = 60, world_size: int | None = None
) -> dist.TCPStore:
    """A store server listening on `host`'s address only (port 0: one the OS picks).

    torch's own server would listen on every interface whatever `host` says; a socket bound
    here and handed over (`master_listen_fd`) is all it listens on. With `world_size` the
    constructor waits (up to `timeout_s`) until that many clients, itself included, connected.
    OSError when `host` is not an address of this host's interfaces (or the port is taken).
    """
    sock = _listening_socket(host, port)
    port = sock.getsockname()[1]
    # the store owns the descriptor from here (detach: the socket object must not close it too)
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=True,
        multi_tenant=True,
        master_listen_fd=sock.detach(),
        wait_for_workers=world_size is not None,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _listening_socket(host: str, port: int) -> socket.socket:
    error: OSError | None = None
    for family, _, _, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(socket.SOMAXCONN)
            return sock
        except OSError as e:
            sock.close()
            error = e
    raise error or OSError(f"{host} has no address")


def register_static() -> str:
    """Make `dpscale-static` known to torch's launcher (idempotent); returns its name.

    torch's static rendezvous (`--node-rank`: each host is told its rank, the host of rank 0
    serves the one store everybody meets in) with that store bound to the endpoint's address.
    """
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(STATIC_BACKEND, _create_static_handler)
    return STATIC_BACKEND


def _create_static_handler(params):
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler

    torchs = create_rdzv_handler(params)  # torch's checks and defaults (rank, port, timeout)
    args = (torchs.master_addr, torchs.master_port, torchs.rank, torchs.world_size, torchs.run_id)
    return _StaticRendezvous(*args, int(torchs.timeout.total_seconds()))


class _StaticRendezvous(StaticTCPRendezvous):
    def get_backend(self) -> str:
        return STATIC_BACKEND

    def next_rendezvous(self):
        if torch_private.static_store(self) is None and self.rank == 0:
            # what torch's handler creates here, on every interface; returns once every host's
            # agent connected (or raises after the timeout)
            timeout_s = self.timeout.total_seconds()
            store = bound_store(self.master_addr, self.master_port, timeout_s, self.world_size)
            torch_private.set_static_store(self, store)
        return super().next_rendezvous()


def register() -> str:
    """Make the backend known to torch's launcher (idempotent); returns its name for LaunchConfig."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create_handler)
    return BACKEND


class _Backend(C10dRendezvousBackend):
    """torch's c10d backend (state kept in the store) under this backend's name."""

    @property
    def name(self) -> str:
        return BACKEND


class _MultiHostBackend(torch_private.StoreCallsBackend):
    """torch's c10d backend whose every store call ends within `read_timeout_s`.

    torch's TCPStore client waits in a plain `recv` for most replies; across hosts, when the link
    to the store's host is cut, no reply and no reset ever come, and the agent (its heartbeat, its
    check for waiting nodes, its shutdown) would wait for as long as TCP retransmits (~15 min).
    """

    def __init__(
        self, store, run_id: str, read_timeout_s: float, endpoint: str = "?", hosts: HostTable | None = None
    ):
        self._read_timeout_s = read_timeout_s  # before torch's constructor, which calls the store
        self._endpoint = endpoint
        self._hosts = hosts
        super().__init__(store, run_id)

    @property
    def name(self) -> str:
        return MULTI_HOST_BACKEND

    def get_state(self):
        return self._observed(super().get_state())

    def set_state(self, state: bytes, token=None):
        return self._observed(super().set_state(state, token))

    def _observed(self, result):
        """`result` (torch's (state bytes, token, ...)), after showing the state to the host table."""
        if result is not None and self._hosts is not None:
            self._hosts.observe(pickle.loads(result[0]))  # noqa: S301 -- what torch's own holder loads
        return result

    def on_store_call(self, call):
        try:
            return bounded(self._read_timeout_s, call)
        except TimeoutError as e:
            no_answer = (
                f"the rendezvous store at {self._endpoint} did not answer within {self._read_timeout_s:g} s"
            )
            lost = self._hosts.unreachable() if self._hosts else []
            if lost:  # name every host this one cannot reach, not only the store's
                raise HostsLost(
                    f"{self._hosts.describe(lost)}: {no_answer}, and "
                    f"{'they do' if len(lost) > 1 else 'it does'} not answer a TCP connect within "
                    f"{PROBE_S:g} s (gone, or cut off from this host)"
                ) from e
            raise HostsLost(f"{no_answer} (its host is gone or cut off from this one)") from e


def _create_handler(params):
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    store = loopback_store()
    handler = create_handler(store, _Backend(store, params.run_id), params)
    # torch's handler would start the agent store on every interface (tests/faults/
    # test_rendezvous_binding.py fails if a release changes how)
    torch_private.replace_agent_store_server(handler, lambda addr, port: loopback_store(port))
    return export_round(handler)


def export_round(handler):
    """Make `handler` put the round it joined in the agent's environment, which the agent's
    workers inherit (torch starts them with a copy of it). Returns the handler."""
    join = handler.next_rendezvous

    def next_rendezvous():
        info = join()
        # tests/launch/test_rendezvous_round.py fails if a release moves it
        os.environ[ROUND_ENV] = str(torch_private.rendezvous_round(handler))
        return info

    handler.next_rendezvous = next_rendezvous
    return handler


def create_multi_host_handler(params):
    """torch's c10d handler under the name dpscale-c10d, exporting the round, with both stores
    bound to the addresses the user named (module docstring)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    # the agent store (on the host that becomes the group's rank 0) is advertised at local_addr:
    # bind that, and without one the address this host reaches the endpoint from, not every interface
    if not params.local_addr:
        params.local_addr = source_address(host)
        if not params.local_addr:
            raise ConfigError(
                f"cannot tell which address of this host the others reach it at (no route to {host}): "
                "give --local-addr"
            )
    store = _rendezvous_store(params, host, port)
    timeout_s = params.get_as_int("read_timeout", 60)
    hosts = HostTable(host, port)
    # every host's name next to its address, before it joins: errors then say "node-03 (10.0.0.3)"
    hosts.publish_name(store, params.run_id, params.local_addr, timeout_s)
    backend = _MultiHostBackend(store, params.run_id, timeout_s, f"{host}:{port}", hosts)
    handler = create_handler(store, backend, params)
    # as for the single-host handler (tests/launch/test_rendezvous_binding_multi_host.py)
    torch_private.replace_agent_store_server(handler, lambda addr, port: bound_store(addr, port, timeout_s))
    names = (store, params.run_id, timeout_s)
    return export_round(_track_hosts(handler, hosts, params.get_as_int(REJOIN_TIMEOUT), names))


def _track_hosts(handler, hosts: HostTable, rejoin_timeout_s: int | None, names: tuple = ()):
    """Make `handler` keep the host table of its last completed round (with the names the hosts
    published, read through `names` = (store, run_id, timeout_s)) and, from then on, wait at most
    `rejoin_timeout_s` (when given) for the hosts to come back after a failure; a wait that ends
    unmet names the hosts that did not rejoin. Returns the handler."""
    join = handler.next_rendezvous

    def next_rendezvous():
        try:
            info = join()
        except RendezvousTimeoutError as e:
            if hosts.round is None:  # the first round: torch's message (who never came is unknown)
                raise
            missing = hosts.not_rejoined()
            seconds = handler.settings.timeout.join.total_seconds()
            raise HostsDidNotRejoin(
                f"{hosts.describe(missing) if missing else 'lost hosts'}: the job waited {seconds:g} s "
                f"for {'it' if len(missing) == 1 else 'them'} to rejoin after a failure and needs at "
                f"least {handler.settings.min_nodes} hosts (--nnodes)"
            ) from e
        except HostsLost:
            raise
        except (RendezvousConnectionError, RendezvousClosedError) as e:
            # another host gave up waiting for the same lost hosts a moment before this one did and
            # closed the rendezvous (or the store's host ended, taking the store with it): say
            # whom this host was waiting for
            missing = hosts.not_rejoined() if hosts.round is not None else []
            if not missing:
                raise
            raise HostsDidNotRejoin(
                f"{hosts.describe(missing)}: {'it' if len(missing) == 1 else 'they'} had not rejoined "
                "after a failure when another host ended the job (the rendezvous "
                f"at {hosts.endpoint_host}:{hosts.endpoint_port} was closed or stopped answering)"
            ) from e
        hosts.record(handler)
        if names:
            hosts.read_names(*names)
        if rejoin_timeout_s is not None:
            # the first round waits torch's join timeout (hosts started by hand); a rejoin after a
            # failure only as long as the hosts that are still there need (nodes.py says how long)
            torch_private.set_join_timeout(handler, rejoin_timeout_s)
        return info

    handler.next_rendezvous = next_rendezvous
    return handler


def _rendezvous_store(params, host: str, port: int) -> dist.TCPStore:
    """torch's c10d store (as its `_create_tcp_store` makes it), served on the endpoint's address
    only: by the host `is_host` names, else the one whose interfaces carry that address."""
    timeout_s = params.get_as_int("read_timeout", 60)
    if timeout_s <= 0:
        raise ConfigError(f"read_timeout must be a positive number of seconds, got {timeout_s}")
    is_host = params.get_as_bool("is_host")
    if is_host is None and carries_address(host):
        try:
            return bound_store(host, port, timeout_s)
        except OSError:
            pass  # another process of this job on this host serves it (torch's own fallback)
    elif is_host:
        try:
            return bound_store(host, port, timeout_s)
        except OSError as e:
            raise RendezvousConnectionError(
                f"is_host=1 but this host cannot serve the rendezvous store on {host}:{port} ({e}): "
                "name an address of this host in --rdzv-endpoint, or set is_host=0"
            ) from e
    try:
        return dist.TCPStore(
            host, port, is_master=False, multi_tenant=True, timeout=datetime.timedelta(seconds=timeout_s)
        )
    except (ValueError, RuntimeError, TimeoutError) as e:
        raise RendezvousConnectionError(f"the rendezvous store at {host}:{port} did not answer: {e}") from e
