"""A script of benchmarks/ imported as a module, for tests of its arithmetic and options."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(path: Path, name: str, monkeypatch=None) -> ModuleType:
    """`path` (a script under benchmarks/) imported as module `name`. The module is in
    sys.modules while it is defined (its dataclasses look their module up there). With pytest's
    `monkeypatch`, benchmarks/ is on sys.path as `python benchmarks/x.py` would have it (a script
    that imports a sibling), and both are undone after the test."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    if monkeypatch is None:
        sys.modules[name] = module
    else:
        monkeypatch.syspath_prepend(str(BENCHMARKS))
        monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)  # defines; runs main() only as __main__
    return module
