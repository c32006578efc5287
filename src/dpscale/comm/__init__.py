"""Transports: the collectives behind the engine, behind one interface (see base.py)."""

from .base import Transport, chunk_bounds
from .hierarchical import HierarchicalTransport
from .process_group import ProcessGroupTransport
from .select import TRANSPORT_NAMES, host_id, make_transport
from .shm import PeerTimeoutError, SharedMemoryTransport

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
