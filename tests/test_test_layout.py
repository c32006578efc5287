"""Any combination of test directories collects: `pytest tests/faults tests/lab/predict` as well as `pytest`.

The test directories are not packages, so pytest imports each test module and conftest under its
bare file name. Two traps follow, and a full run does not show either one, because it loads each
directory's conftest just before collecting that directory:
- `from conftest import X` gets whichever conftest was imported last. Given several directories,
  pytest loads all their conftests first, so a test imported the wrong one (faults vs predict).
  Shared helpers live in tests/support (importable as `support.*`); a conftest only holds fixtures.
- two test files with the same name in different directories clash ("import file mismatch").
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "support" not in p.relative_to(TESTS).parts)


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add(node.module or "")
    return names


def test_no_test_imports_a_conftest():
    offenders = [
        str(p.relative_to(TESTS))
        for p in _test_files() + list((TESTS / "support").rglob("*.py"))
        if any(name.split(".")[0] == "conftest" for name in _imported_modules(p))
    ]
    assert not offenders, f"move what {offenders} import from a conftest into tests/support/"


def test_test_module_names_are_unique():
    counts = Counter(p.name for p in _test_files() if p.name != "conftest.py")
    twice = sorted(name for name, n in counts.items() if n > 1)
    assert not twice, f"rename one of each: {twice} (test modules are imported by file name)"
