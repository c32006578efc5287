"""The shm transport's C helper for small all-reduces (shm_small.c): built, cached, loaded.

The one-round path's work is a few microseconds of copying, one store and a sum; in Python it
takes ~20 interpreter calls that cost more than the bytes (docs/architecture.md, "Why a C helper
for small all-reduces"). shm_small.c does it in one foreign call.

It is built as a CPython extension module where this interpreter's headers are installed (its two
calls then cost ~20 ns each, against ~90 through ctypes: a tenth of a 4 B all-reduce), else as a
plain shared library called through ctypes.

The C file ships in the package and is compiled at first use with the system C compiler (`$CC`,
else `cc`) into `$XDG_CACHE_HOME/dpscale` (default `~/.cache/dpscale`), a file named by the hash
of the source, compiler and flags, so an upgrade or another compiler builds afresh and ranks that
build at once each write a file of their own and rename it into place. Nothing is downloaded.
Where there is no compiler, the build fails, the cache is not this user's alone, or
`DPSCALE_SHM_NATIVE=0` is set, `library()` returns None and the Python path runs: the same
additions in the same order, so the same bits.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

from dpscale.log import get_logger

_SOURCE = Path(__file__).with_name("shm_small.c")
# -O3: vectorized adds (element by element, so the same IEEE additions); no -ffast-math (it would
# reassociate the sums); no contraction into fused multiply-adds; no -march (the cache may be
# shared by hosts of different CPUs)
_FLAGS = ("-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math")
_BUILD_TIMEOUT_S = 120
ENV_SWITCH = "DPSCALE_SHM_NATIVE"  # "0": never build or load the helper
_MODULE = "_dps_shm_small"  # its PyInit_ function's name in shm_small.c

log = get_logger(__name__)


class Plan(ctypes.Structure):
    """One small all-reduce, as shm_small.c's `struct dps_small_plan` (same fields, same order)."""

    _fields_ = [
        ("lines", ctypes.c_void_p),
        ("boxes", ctypes.c_void_p),
        ("tensor", ctypes.c_void_p),
        ("nbytes", ctypes.c_int64),
        ("bounds", ctypes.c_void_p),
        ("orders", ctypes.c_void_p),
        ("nranges", ctypes.c_int32),
        ("world", ctypes.c_int32),
        ("rank", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
        ("wake", ctypes.c_int32),
        ("ll", ctypes.c_int32),
        ("wait", ctypes.c_void_p),
    ]


class Wait(ctypes.Structure):
    """How the helper waits for its peers, as shm_small.c's `struct dps_wait`: one per transport,
    which every plan points to. The first five are set by the transport (shm_wait.Counters); the
    rest is the helper's (its backoff after slow yields, and counts for tests and probes)."""

    _fields_ = [
        ("spin_ns", ctypes.c_int64),
        ("yield_ns", ctypes.c_int64),
        ("slow_ns", ctypes.c_int64),
        ("backoff_min", ctypes.c_int64),
        ("backoff_max", ctypes.c_int64),
        ("skip", ctypes.c_int64),
        ("backoff", ctypes.c_int64),
        ("yielded", ctypes.c_int64),
        ("slow", ctypes.c_int64),
    ]


class Helper:
    """The loaded helper's calls: `all_reduce(plan_arg(plan))` -> 0 (done) or 1 (wait, then
    `sum(plan_arg(plan), slot)`), and `wait_all(plan_arg(plan), seq)` -> 0 (every peer reached
    collective seq) or 1 (not within the helper's wait). Through ctypes the first two leave their
    arguments undeclared (no `argtypes`): ctypes then passes a `byref` and a small int as they
    are, where declared types cost ~0.2 us a call in conversions. Loaded as a `PyDLL`, or as a
    module: its calls keep the GIL, which a plain `CDLL` releases and takes back around each call
    (~0.03 us, and a wait for any other thread that took it meanwhile); the longest they hold it is
    the helper's spin for its peers, a few us, and the Python wait that follows sleeps without it.
    Where ranks share CPUs the helper yields instead, up to 200 us, still holding it: letting it
    go around the yields (the module can) cost 1-5 us a call at 4 ranks on 2 cores (BENCHMARKS.md)."""

    def __init__(self, lib: ctypes.CDLL | ModuleType):
        self.lib = lib  # kept: the functions below live in it
        self.module = isinstance(lib, ModuleType)
        if isinstance(lib, ModuleType):
            self.all_reduce, self.sum, self.wait_all = lib.all_reduce, lib.sum, lib.wait_all
        else:
            self.all_reduce = lib.dps_small_all_reduce
            self.all_reduce.restype = ctypes.c_int
            self.sum = lib.dps_small_sum
            self.sum.restype = None
            wait_all = lib.dps_wait_all
            wait_all.restype = ctypes.c_int
            self.wait_all = lambda plan, seq: wait_all(plan, ctypes.c_int64(seq))

    def plan_arg(self, plan: ctypes.Structure) -> object:
        """How the calls take `plan`: its address (the module), or a ctypes reference."""
        return ctypes.addressof(plan) if self.module else ctypes.byref(plan)


@functools.cache
def library() -> Helper | None:
    """The helper, built on first use; None where it cannot be (then the Python path runs)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return None  # the shm transport runs only there (select.shm_is_safe)
    try:
        return Helper(_load_module(_built(as_module=True)))
    except (OSError, subprocess.SubprocessError, ImportError) as e:
        # not worth a line in every rank's output: the ctypes build below does the same work
        log.debug("shm: C helper as an extension module unavailable (%s); trying ctypes", e)
    try:
        return Helper(ctypes.PyDLL(str(_built(as_module=False))))
    except (OSError, subprocess.SubprocessError) as e:
        log.info("shm: C helper unavailable (%s); small all-reduces run in Python", e)
        return None


def _load_module(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(_MODULE, str(path))
    spec = importlib.util.spec_from_loader(_MODULE, loader)
    if spec is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _module_flags() -> tuple[str, ...]:
    include = sysconfig.get_paths()["include"]
    if not os.path.isfile(os.path.join(include, "Python.h")):
        raise OSError(f"no Python.h in {include} (the interpreter's headers are not installed)")
    # the interpreter's ABI is in the cache name too: another Python builds its own
    return ("-DDPS_PYTHON_MODULE", f"-I{include}", f"-DDPS_ABI={sys.implementation.cache_tag}")


def _compiler() -> str:
    cc = os.environ.get("CC") or "cc"
    path = shutil.which(cc)
    if path is None:
        raise OSError(f"no C compiler {cc!r} on PATH")
    return path


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = Path(base) / "dpscale"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = folder.stat()
    # a library loaded from a folder someone else can write to runs their code
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise OSError(f"{folder} is not this user's alone")
    return folder


def _built(*, as_module: bool) -> Path:
    cc = _compiler()
    source = _SOURCE.read_bytes()
    flags = (*_FLAGS, *_module_flags()) if as_module else _FLAGS
    tag = hashlib.sha256(b"\0".join([source, cc.encode(), " ".join(flags).encode()])).hexdigest()[:16]
    folder = _cache_dir()
    lib = folder / f"shm_small-{tag}.so"
    if lib.exists():
        return lib
    fd, tmp = tempfile.mkstemp(prefix=".shm_small-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *flags, "-o", tmp, str(_SOURCE)],
            check=True,
            capture_output=True,
            timeout=_BUILD_TIMEOUT_S,
        )
        os.replace(tmp, lib)  # atomic: a rank never loads a half-written file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib
