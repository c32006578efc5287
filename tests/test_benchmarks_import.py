"""Every script under benchmarks/ still imports: a module split or a renamed name in the package
must move their imports too (they run rarely, so nothing else would notice)."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py")) + sorted((BENCHMARKS / "predict_lab").glob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_the_benchmark_imports(path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as `python benchmarks/x.py` runs it
    name = "_bench_" + "_".join(path.relative_to(BENCHMARKS).with_suffix("").parts)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)  # defines; runs main() only as __main__
