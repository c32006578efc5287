"""Output locations the user names (--checkpoint-dir, --metrics-dir, --report-dir, --out), checked
before any work: a directory that cannot be written costs one line and exit code 2, not the
traceback that ends a run whose results were measured and then lost.

The checks look, never create: a command refused here has written nothing. What dpscale writes
there goes through `open_no_follow`, which refuses a symbolic link planted in its place.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import IO

from dpscale.errors import ConfigError


def check_writable_dir(flag: str, path: str | os.PathLike[str]) -> None:
    """`path` is a directory this user can write, or can be created as one (nothing is created)."""
    p = Path(path).absolute()
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {path} is a file, not a directory; name a directory")
    existing = p
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{flag} {path} cannot be created: {existing} is a file; name another directory")
    # access() also says no for a read-only mount (EROFS), which a permission check alone would not
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is" if existing == p else f"would be created in {existing}, which is"
        raise ConfigError(
            f"{flag} {path} {what} not writable (read-only mount or permissions); name a writable directory"
        )


def check_writable_file(flag: str, path: str | os.PathLike[str]) -> None:
    """`path` can be written as a file: not a directory, in a directory that is or can be made.

    When its directory exists, the file is opened for writing (and a file made for the test removed
    again): permission bits say nothing for root, and /proc or /sys refuse files whatever they say."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {path} is a directory; name a file in it, e.g. {p / 'profile.json'}")
    check_writable_dir(flag, p.absolute().parent)
    if not p.absolute().parent.is_dir():
        return  # it will be made: check_writable_dir vouched for where
    existed = p.exists() or p.is_symlink()
    try:
        open_no_follow(p, "a").close()
    except OSError as e:
        raise ConfigError(f"{flag} {path} cannot be written ({e.strerror}); name another file") from None
    if not existed:
        p.unlink(missing_ok=True)


def open_no_follow(path: str | os.PathLike[str], mode: str = "w", **kwargs) -> IO:
    """`open(path, mode)` for writing ("w", "a", "wb", "ab"), refusing a symbolic link, a FIFO or a
    device where a file is expected: anyone who can write the directory could otherwise point
    `metrics.jsonl` (say) at a file of the user running dpscale, which would be truncated and
    overwritten. A ConfigError names the path; other OSErrors pass."""
    assert mode in ("w", "a", "wb", "ab"), mode
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    flags |= os.O_APPEND if mode.startswith("a") else 0
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):  # a link; a FIFO nobody reads
            raise ConfigError(_not_a_file(path)) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(_not_a_file(path))
        os.set_blocking(fd, True)
        if not mode.startswith("a"):
            os.ftruncate(fd, 0)  # only now that it is known to be a regular file
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def write_no_follow(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write `data` to the file `path` (open_no_follow's checks), replacing what it held."""
    with open_no_follow(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


def _not_a_file(path: str | os.PathLike[str]) -> str:
    return (
        f"{path} is a symbolic link or not a regular file; dpscale writes only regular files "
        "and does not follow links there: remove it, or name another location"
    )
