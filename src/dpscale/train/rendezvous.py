"""The rendezvous of a single-host job, reachable from this host only.

torch's stores (`TCPStore`) have no authentication, and a store server listens on every interface
whatever host name it is given: anyone who can reach the port can join or disrupt the job. For a
job on one host the launcher therefore creates both of the agent's store servers itself, on
sockets bound to 127.0.0.1, and hands them to torch (`master_listen_fd`):

- the rendezvous store (torch's c10d rendezvous backend holds its state there), and
- the agent store the workers' process group meets in (TORCHELASTIC_USE_AGENT_STORE), which
  torch's handler would create on a port of its own; `_create_tcp_store_server` is replaced.

A multi-host job (torchrun on each host) binds what its user names; see docs/fault-tolerance.md.
It should use the `dpscale-c10d` backend (torch's c10d, registered for torchrun through the
`torchrun.handlers` entry point, torchrun_plugin.py): like every handler here it tells the
workers the rendezvous round (`DPSCALE_RDZV_ROUND`), the one attempt number all hosts share
(comm/attempt.py).
"""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from ..comm.attempt import ROUND_ENV

BACKEND = "dpscale-loopback"
MULTI_HOST_BACKEND = "dpscale-c10d"
LOOPBACK = "127.0.0.1"


def loopback_store(port: int = 0) -> dist.TCPStore:
    """A store server listening on 127.0.0.1 only (port 0: one the OS picks)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, port))
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    # the store owns the descriptor from here (detach: the socket object must not close it too)
    return dist.TCPStore(
        LOOPBACK,
        port,
        is_master=True,
        multi_tenant=True,
        master_listen_fd=sock.detach(),
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )


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


class _MultiHostBackend(C10dRendezvousBackend):
    @property
    def name(self) -> str:
        return MULTI_HOST_BACKEND


def _create_handler(params):
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    store = loopback_store()
    handler = create_handler(store, _Backend(store, params.run_id), params)
    # torch's handler would start the agent store on every interface (private API: pinned torch
    # range, and tests/faults/test_rendezvous_binding.py fails if a release changes it)
    handler._create_tcp_store_server = lambda addr, port: loopback_store(port)
    return export_round(handler)


def export_round(handler):
    """Make `handler` put the round it joined in the agent's environment, which the agent's
    workers inherit (torch starts them with a copy of it). Returns the handler."""
    join = handler.next_rendezvous

    def next_rendezvous():
        info = join()
        # private state of torch's DynamicRendezvousHandler (pinned torch range;
        # tests/train/test_rendezvous_round.py fails if a release moves it)
        os.environ[ROUND_ENV] = str(handler._state_holder.state.round)
        return info

    handler.next_rendezvous = next_rendezvous
    return handler


def create_multi_host_handler(params):
    """torch's c10d handler under the name dpscale-c10d, exporting the round."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    # torch's c10d store (on the host params.config's is_host or the endpoint's name picks)
    _, store = create_backend(params)
    return export_round(create_handler(store, _MultiHostBackend(store, params.run_id), params))
