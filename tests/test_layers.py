"""The package's layers hold: no module imports a layer above its own, and no two files import each other.

Every module under src/dpscale is parsed (imports inside functions and under TYPE_CHECKING count:
a lazy import is still a dependency). The layers, bottom up, are docs/architecture.md's table:
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "dpscale"

# bottom up; a module may import its own layer and those below. The key is the first name under
# dpscale/ (a sub-package or a top-level module); "dpscale" is the package's own __init__.
LAYERS: list[set[str]] = [
    {"version", "cores", "errors", "flags", "log", "paths", "torch_range"},  # base: no dpscale imports at all
    {"comm"},
    {"engine"},
    {"optim", "data", "workloads"},
    # integrations: the engine under Lightning and Accelerate (nothing of dpscale imports it)
    {"train", "integrations"},
    {"launch"},  # everything that starts processes: train's workers, a user's torchrun script, hosts
    {"lab", "testing"},  # bench, predict, check; testing: fault injection through callbacks
    {"cli", "dpscale"},
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The dpscale modules `name` imports, resolved to files (a package means its __init__)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            # `from . import x` imports the module x when there is one, else a name from the package
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import dpscale.x.y` where y is a name
                target = target.rpartition(".")[0]
            if target.startswith("dpscale"):
                found.add(target)
    found.discard(name)
    return found


def _layer_key(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "dpscale"


def _graph() -> dict[str, set[str]]:
    return {name: set(deps) for name, deps in _parsed_graph().items()}


@functools.cache  # parsing every module takes a second; the tests here read one graph
def _parsed_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_has_a_layer():
    unplaced = sorted({_layer_key(n) for n in _modules()} - set(LAYER_OF))
    assert not unplaced, f"place {unplaced} in LAYERS here and in docs/architecture.md"


def test_no_module_imports_a_layer_above_its_own():
    upward = [
        f"{name} (layer {LAYER_OF[_layer_key(name)]}) imports {dep} (layer {LAYER_OF[_layer_key(dep)]})"
        for name, deps in _graph().items()
        for dep in sorted(deps)
        if LAYER_OF.get(_layer_key(dep), 0) > LAYER_OF.get(_layer_key(name), 0)
    ]
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def _package_edges_removed(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    # A package's __init__ re-exports its modules, and they in turn import siblings through the
    # package (`from ..comm import X`): that is one file's interface, not a cycle between files.
    def is_own_package(name: str, dep: str) -> bool:
        return name.startswith(dep + ".") and (SRC / dep.replace(".", "/")).is_dir()

    return {name: {d for d in deps if not is_own_package(name, d)} for name, deps in graph.items()}


def test_no_import_cycles_between_files():
    cycles = _cycles(_package_edges_removed(_graph()))
    listed = "\n".join(" <-> ".join(c) for c in cycles)
    assert not cycles, f"import cycles (one of the files holds a concept that belongs in a third):\n{listed}"


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ],
)
def test_the_cycle_finder_finds_cycles(graph, expected):
    assert _cycles(graph) == expected


def test_the_import_reader_sees_imports_inside_functions(tmp_path):
    modules = _modules()
    path = PACKAGE / "launch" / "worker.py"
    assert "dpscale.launch.protocol" in _imports("dpscale.launch.worker", path, modules)
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    from ..cli import main\n")
    assert _imports("dpscale.train.lazy", lazy, modules) == {"dpscale.cli.main"}


def _importers_of(layer: str) -> dict[str, set[str]]:
    return {
        name: {d for d in deps if _layer_key(d) == layer}
        for name, deps in _graph().items()
        if _layer_key(name) != layer and any(_layer_key(d) == layer for d in deps)
    }


def test_only_the_cli_imports_the_lab():
    # the engine and the Trainer install and run without the lab's packages (matplotlib, sklearn, rich)
    outside = {n: d for n, d in _importers_of("lab").items() if _layer_key(n) != "cli"}
    assert not outside, f"only cli/ may import the lab: {outside}"


def test_train_never_imports_launch():
    # the launcher starts workers that run the Trainer; the Trainer knows nothing of how it was started
    upward = {n: d for n, d in _importers_of("launch").items() if _layer_key(n) == "train"}
    assert not upward, f"train/ imports launch/: {upward}"


def _package_graph() -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for name, deps in _graph().items():
        packages.setdefault(_layer_key(name), set()).update(_layer_key(d) for d in deps)
    return {k: v - {k} for k, v in packages.items()}


def test_no_cycles_between_packages():
    # "dpscale" (the package's own __init__) re-exports the public API and is imported by nothing
    graph = {k: v - {"dpscale"} for k, v in _package_graph().items()}
    assert not _cycles(graph), f"package-level import cycles: {_cycles(graph)}"


def test_the_architecture_page_names_every_engine_and_comm_module():
    # docs/architecture.md's layer table lists the files of the product's heart; a new one goes there too
    page = (SRC.parent / "docs" / "architecture.md").read_text()
    unnamed = [
        f"{path.parent.name}/{path.name}"
        for folder in ("comm", "engine")
        for path in sorted((PACKAGE / folder).glob("*.py"))
        if path.name != "__init__.py" and f"`{path.name}`" not in page
    ]
    assert not unnamed, f"name these in docs/architecture.md's layer table (what each holds): {unnamed}"
