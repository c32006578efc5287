"""The torch releases dpscale is tested on, and the import-time check of the running torch against them.

pyproject's `torch>=2.11` has no upper bound: a newer torch is the user's to choose, and dpscale's
private torch surface lives in one module per layer that checks each name on first use
(engine/compat/torch_private.py, launch/torch_private.py; comm/ needs none). So a torch newer
than the newest tested release imports with one warning line; an older one than the floor is
refused here, at import, instead of failing later on whichever private name it lacks.
docs/torch-versions.md says how each release below was tested.
"""

from __future__ import annotations

import re
import sys
import warnings
from importlib import metadata

# The floor: pyproject's `torch>=` (tests/test_torch_range.py keeps the two equal).
OLDEST_SUPPORTED = (2, 11)
# The newest release line the tests ran on; a later one gets UntestedTorchWarning, never a refusal.
NEWEST_TESTED = (2, 15)
# Each release the tests ran on, and how (docs/torch-versions.md has the dates and counts).
TESTED_RELEASES = {
    "2.11.0": "by hand: the compat tier's engine and launcher tests (3 bugs found, fixed, re-run)",
    "2.13.0": "CI: the full suite (make test)",
    "2.14.1": "CI: the compat tier (make test-compat)",
    "2.15.0": "by hand: the compat tier's engine and launcher tests (101 passed)",
}


class UntestedTorchWarning(UserWarning):
    """The running torch is newer than every release dpscale's tests ran on."""


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version: "2.14.1+cu128" -> (2, 14), "2.16.0.dev20270101" -> (2, 16)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"cannot read a torch release from the version {version!r}")
    return int(match[1]), int(match[2])


def check_torch_version(version: str) -> None:
    """Refuse a torch older than the floor; warn, in one line, about one newer than the tested range.

    Older is an ImportError because pyproject already excludes it (only `--no-deps` or a source
    path gets here), and what breaks there is not a warning's worth: torch-private names the
    engine and launcher rely on, failing mid-run instead of at import."""
    running = release(version)
    if running < OLDEST_SUPPORTED:
        oldest = ".".join(map(str, OLDEST_SUPPORTED))
        raise ImportError(
            f"dpscale needs torch>={oldest}, and torch {version} is installed: pip install 'torch>={oldest}'"
        )
    if running > NEWEST_TESTED:
        newest = ".".join(map(str, NEWEST_TESTED))
        # warn_explicit with a location that has no source line: the warning is one line, and
        # `-W ignore::dpscale.torch_range.UntestedTorchWarning` (or filterwarnings) silences it
        warnings.warn_explicit(
            f"torch {version} is newer than the releases dpscale was tested on (up to {newest}.x); "
            "please report what breaks",
            UntestedTorchWarning,
            filename="dpscale",
            lineno=0,
            module="dpscale.torch_range",
        )


def check_running_torch() -> None:
    """check_torch_version for the installed torch, without importing it when it is not yet
    (`import dpscale` stays fast): its version then comes from its installed metadata."""
    check_torch_version(_torch_version())


def _torch_version() -> str:
    imported = sys.modules.get("torch")
    if imported is not None:  # already imported (possibly with a version set by hand, as tests do)
        return imported.__version__
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:  # torch from a source tree, without metadata
        import torch

        return torch.__version__
