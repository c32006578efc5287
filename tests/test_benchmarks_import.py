"""Every script under benchmarks/ still imports: a module split or a renamed name in the package
must move their imports too (they run rarely, so nothing else would notice)."""

import pytest

from support.benchmark_module import BENCHMARKS, load_benchmark

SCRIPTS = [p for folder in ("", "predict_lab", "peers") for p in sorted((BENCHMARKS / folder).glob("*.py"))]


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_the_benchmark_imports(path, monkeypatch):
    name = "_bench_" + "_".join(path.relative_to(BENCHMARKS).with_suffix("").parts)
    load_benchmark(path, name, monkeypatch)
