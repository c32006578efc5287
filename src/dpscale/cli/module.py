"""`dpscale run -m MODULE`: torchrun's spelling for a script named as a module.

The module's file (a package's `__main__.py`) is what the workers run, found as `python -m` finds
it: from the current directory first, then sys.path. It then runs as a script does, its own
directory first on sys.path; a module that uses relative imports (`from . import x`) is refused
here with one line rather than failing in every worker.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dpscale.errors import ConfigError
from dpscale.flags import flag_spec


@dataclass(frozen=True, kw_only=True)
class ModuleFlag:
    """`dpscale run`'s flag besides RunConfig's: how SCRIPT is named."""

    module: bool = field(default=False, metadata=flag_spec(aliases=("-m",)))
    """SCRIPT names a module (as torchrun -m and python -m do): its file runs as the script."""


def module_file(name: str) -> str:
    """The file `python -m name` would run; ConfigError when there is none."""
    sys.path.insert(0, os.getcwd())  # as python -m: the current directory first
    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:  # a package: its __main__
            spec = importlib.util.find_spec(f"{name}.__main__")
    except (ImportError, ValueError) as e:
        raise ConfigError(f"-m: cannot find module {name!r} ({e})") from None
    finally:
        sys.path.pop(0)
    if spec is None or spec.origin is None or not Path(spec.origin).is_file():
        raise ConfigError(f"-m: no module {name!r} here or on sys.path; give its dotted name, e.g. -m train")
    if spec.parent and "from ." in Path(spec.origin).read_text(errors="replace"):
        raise ConfigError(
            f"-m {name}: the module uses relative imports, which dpscale run cannot give it; "
            f"run it as a script path instead"
        )
    return spec.origin
