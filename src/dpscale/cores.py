"""How many cores this process may use: the launcher splits them over workers, benches report them."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), which can be fewer than the machine has."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# how many threads or processes per usable core a count flag may ask for: past a few per core they
# only queue for the CPU, and a typo's 100000 threads use up the host's process limit for everyone
# (fork fails with EAGAIN elsewhere) before the run dies with SIGSEGV (issue 34)
PER_CORE = 4


def over_host_cap(what: str, value: int) -> str | None:
    """None when `value` threads or processes fit this host (at most PER_CORE x its usable cores),
    else the one-line refusal naming the bound."""
    cores = usable_cores()
    if value <= PER_CORE * cores:
        return None
    cap = f"{PER_CORE * cores} ({PER_CORE} x the {cores} cores this process may use)"
    return f"{what} must be at most {cap}, got {value}"
