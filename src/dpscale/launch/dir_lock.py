"""One job per checkpoint directory: `dpscale train` holds an exclusive lock on it for the whole run.

Two jobs writing one directory corrupt each other (each takes the other's temporary directories
for leftovers of a killed writer). The lock is `flock` on the directory itself, so it adds no
file, goes away with the process however it ends (kill -9 included), and names its holder:
/proc/locks lists the PID that holds a lock on an inode. The lock belongs to the job, not to a
worker: the launcher takes it before any worker starts. A job spanning hosts would take it once,
in the process that coordinates the job (not done yet: under torchrun nobody takes it).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from dpscale.errors import ConfigError


class DirectoryInUse(ConfigError):
    """Another process holds the directory; the message names its PID."""


@contextlib.contextmanager
def hold(directory: str, flag: str = "--checkpoint-dir") -> Iterator[None]:
    """Create `directory` if needed and hold its lock until the block ends; DirectoryInUse if taken."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)  # close-on-exec: workers never inherit it
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock_holder(fd)
            who = f"the process with PID {holder}" if holder else "another process"
            raise DirectoryInUse(
                f"{flag} {directory} is in use by {who} (another dpscale train job); wait for it to end "
                "or name another directory"
            ) from None
        yield
    finally:
        os.close(fd)  # releases the lock


def lock_holder(fd: int) -> int | None:
    """The PID holding a flock on the file `fd` refers to, from /proc/locks (None if unknown)."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        # "1: FLOCK  ADVISORY  WRITE 12345 08:01:1234567 0 EOF"; "->" marks a waiter
        fields = line.split()
        if "->" not in fields and len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode:
            return int(fields[4])
    return None
