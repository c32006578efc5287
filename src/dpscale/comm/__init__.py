"""Transports: the collectives behind the engine, behind one interface (see base.py)."""

from dpscale.comm.base import Transport, chunk_bounds
from dpscale.comm.hierarchical import HierarchicalTransport
from dpscale.comm.process_group import ProcessGroupTransport
from dpscale.comm.select import TRANSPORT_NAMES, host_id, make_transport
from dpscale.comm.shm import PeerTimeoutError, SharedMemoryTransport

__all__ = [
    "TRANSPORT_NAMES",
    "HierarchicalTransport",
    "PeerTimeoutError",
    "ProcessGroupTransport",
    "SharedMemoryTransport",
    "Transport",
    "chunk_bounds",
    "host_id",
    "make_transport",
]
