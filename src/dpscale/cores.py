"""How many cores this process may use: the launcher splits them over workers, benches report them."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), which can be fewer than the machine has."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
