"""Describe the machine and software a measurement was taken on, for the head of every report.

A bench number without its hardware, versions and source revision cannot be compared with another
one later, so every report.json carries `collect_system_info()` verbatim. The layout (documented
JSON):

    {
      "hostname": str,
      "timestamp_utc": "2026-11-29T18:30:12Z",
      "hardware": {"cpu_model": str, "logical_cores": int, "usable_cores": int,
                   "memory_GiB": float | null, "gpus": [str, ...]},
      "software": {"python": str, "torch": str, "dpscale": str, "numpy": str, "platform": str,
                   "git_revision": str | null, "git_dirty": bool,
                   "cuda": str | null, "cudnn": str | null, "nccl": str | null}
    }

cuda, cudnn and nccl are the versions torch was built with, as torch's collect_env reports them
(null in a CPU build); reports written before they were kept lack the three keys.

`usable_cores` is what this process may run on (CPU affinity, e.g. a container's limit), which can
be far below `logical_cores`. `git_dirty` is false when there is no git checkout (revision null).
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import subprocess
from pathlib import Path

import numpy
import torch

from dpscale.cores import usable_cores
from dpscale.version import __version__

# git can hang on a network file system or a lock; a report must not.
_GIT_TIMEOUT_S = 5.0


def collect_system_info() -> dict:
    return {
        "hostname": socket.gethostname(),
        "timestamp_utc": utc_timestamp(),
        "hardware": {
            "cpu_model": _cpu_model(),
            "logical_cores": os.cpu_count() or 1,
            "usable_cores": usable_cores(),
            "memory_GiB": _memory_GiB(),
            "gpus": _gpus(),
        },
        "software": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "dpscale": __version__,
            "numpy": numpy.__version__,
            "platform": platform.platform(),
            **_git_state(Path(__file__).resolve().parents[1]),
            **_accelerator_libraries(),
        },
    }


def _accelerator_libraries() -> dict:
    """CUDA, cuDNN and NCCL versions of this torch build (collect_env's facts, without its
    subprocesses); None for what the build lacks."""
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except (AttributeError, RuntimeError):  # a CPU build has no NCCL bindings
        nccl = None
    return {"cuda": torch.version.cuda, "cudnn": str(cudnn) if cudnn else None, "nccl": nccl}


def utc_timestamp() -> str:
    """Now in UTC, ISO 8601 to the second with a Z: "2026-11-29T18:30:12Z"."""
    now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    return now.isoformat().replace("+00:00", "Z")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            # x86 says "model name"; some ARM kernels only say "Hardware" or "Processor"
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Hardware", "Processor") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _memory_GiB() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) * 1024 / 2**30, 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _gpus() -> list[str]:
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(
            # --no-optional-locks: `git status` would otherwise refresh (write) the index of a
            # tree that other people are working in.
            ["git", "--no-optional-locks", *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=_GIT_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _git_state(source_dir: Path) -> dict:
    revision = _git(["rev-parse", "--short", "HEAD"], source_dir)
    if revision is None:  # an installed wheel, or no git on this machine
        return {"git_revision": None, "git_dirty": False}
    # Untracked files are left out: outputs such as reports/ do not change the code that ran.
    status = _git(["status", "--porcelain", "--untracked-files=no"], source_dir)
    return {"git_revision": revision.strip(), "git_dirty": bool(status and status.strip())}


def describe_system(info: dict) -> list[str]:
    """Markdown bullet lines (hardware, software, host) for the head of a report."""
    hw, sw = info["hardware"], info["software"]
    memory = f"{hw['memory_GiB']} GiB RAM" if hw.get("memory_GiB") is not None else "RAM unknown"
    cores = f"{hw['logical_cores']} logical cores"
    if hw.get("usable_cores") not in (None, hw["logical_cores"]):
        cores += f" ({hw['usable_cores']} usable by this process)"
    gpus = ", ".join(hw["gpus"]) if hw["gpus"] else "none"
    revision = sw.get("git_revision") or "unknown (not a git checkout)"
    if sw.get("git_dirty"):
        revision += " with uncommitted changes"
    if "cuda" in sw:  # kept since reports name the accelerator libraries
        libraries = (
            f" (CUDA {sw['cuda']}, cuDNN {sw.get('cudnn') or 'none'}, NCCL {sw.get('nccl') or 'none'})"
            if sw["cuda"]
            else " (CPU build: no CUDA)"
        )
    else:
        libraries = ""
    return [
        f"- **Hardware:** {hw['cpu_model']}, {cores}, {memory}; GPUs: {gpus}",
        f"- **Software:** Python {sw['python']}, torch {sw['torch']}{libraries}, numpy {sw['numpy']}, "
        f"dpscale {sw['dpscale']} (git {revision}); {sw['platform']}",
        f"- **Host:** {info['hostname']}, measured {info['timestamp_utc']}",
    ]
