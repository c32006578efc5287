"""Output locations the user names (--checkpoint-dir, --metrics-dir, --report-dir, --out), checked
before any work: a directory that cannot be written costs one line and exit code 2, not the
traceback that ends a run whose results were measured and then lost.

The checks look, never create: a command refused here has written nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

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
    """`path` can be written as a file: not a directory, in a directory that is or can be made."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {path} is a directory; name a file in it, e.g. {p / 'profile.json'}")
    check_writable_dir(flag, p.absolute().parent)
