"""torch's private surface is touched in one module per layer, and nowhere else in src/dpscale.

A private name is any leading-underscore (not dunder) torch module or attribute: `torch._C.Future`,
`torch._foreach_copy_`, `dist.distributed_c10d._get_default_group()`, `import torch._dynamo`,
`from torch.distributed.elastic.agent.server import api; api._RoleInstanceInfo`,
`getattr(torch.distributed, "_x")`. Each use lives in one of ALLOWED, which checks on first use
that the name exists in the running torch (STYLE.md: a new torch release is a one-file change).

The detector is static: it follows names bound by importing torch (and plain assignments of them,
`c10d = dist.distributed_c10d`), through attributes, calls and subscripts. It cannot see a private
attribute of an object whose torch origin is a function argument or a return value stored away
(`pg = new_group(); pg._x`); those are the reviewers' to catch.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "dpscale"
ALLOWED = {
    "engine/compat/torch_private.py",
    "launch/torch_private.py",
}
_REFLECTION = {"getattr", "hasattr", "setattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_module(dotted: str) -> bool:
    return dotted.split(".")[0] == "torch" and any(_private(part) for part in dotted.split("."))


def _torch_aliases(tree: ast.AST) -> set[str]:
    """The names in a module bound to torch or to something imported from it (all scopes)."""
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    aliases.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] == "torch":
                aliases.update(a.asname or a.name for a in node.names)
    # `c10d = dist.distributed_c10d` makes c10d an alias too; repeat until nothing new is bound
    assignments = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)]
    while True:
        new = {
            target.id
            for n in assignments
            if _root(n.value) in aliases
            for target in n.targets
            if isinstance(target, ast.Name) and target.id not in aliases
        }
        if not new:
            return aliases
        aliases |= new


def _root(node: ast.AST) -> str | None:
    """The name an attribute chain starts at, through calls and subscripts: `a.b().c[0].d` -> "a"."""
    while True:
        if isinstance(node, ast.Attribute):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Name):
            return node.id
        else:
            return None


def private_torch_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for each use of a private torch name in `source`."""
    tree = ast.parse(source)
    aliases = _torch_aliases(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if _private_module(a.name)]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] != "torch":
                continue
            if _private_module(node.module):
                found.append((node.lineno, f"from {node.module} import ..."))
            else:
                names = [a.name for a in node.names if _private(a.name)]
                found += [(node.lineno, f"from {node.module} import {n}") for n in names]
        elif isinstance(node, ast.Attribute) and _private(node.attr) and _root(node.value) in aliases:
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2:
            target, name = node.args[0], node.args[1]
            if (
                node.func.id in _REFLECTION
                and _root(target) in aliases
                and isinstance(name, ast.Constant)
                and isinstance(name.value, str)
                and _private(name.value)
            ):
                found.append((node.lineno, ast.unparse(node)))
        if isinstance(node, ast.Call) and _is_import_module(node):
            module = node.args[0]
            if isinstance(module, ast.Constant) and isinstance(module.value, str):
                if _private_module(module.value):
                    found.append((node.lineno, ast.unparse(node)))
    found += _private_super_calls(tree, aliases)
    return sorted(set(found))


def _private_super_calls(tree: ast.AST, aliases: set[str]) -> list[tuple[int, str]]:
    """`super()._x` in a class derived from a torch class: reaching into torch's private methods."""
    found = []
    for cls in ast.walk(tree):
        if not (isinstance(cls, ast.ClassDef) and any(_root(b) in aliases for b in cls.bases)):
            continue
        for node in ast.walk(cls):
            if (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name)
                and node.value.func.id == "super"
            ):
                found.append((node.lineno, f"{cls.name}: {ast.unparse(node)}"))
    return found


def _is_import_module(call: ast.Call) -> bool:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in {"import_module", "__import__"} and bool(call.args)


def _offenders() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative in ALLOWED:
            continue
        for line, what in private_torch_uses(path.read_text()):
            out.append(f"src/dpscale/{relative}:{line}: {what}")
    return out


def test_private_torch_names_live_only_in_the_torch_private_modules():
    offenders = _offenders()
    assert not offenders, (
        f"{len(offenders)} private torch names outside {sorted(ALLOWED)}; move each into its layer's "
        "torch_private.py, checked on first use against the running torch:\n" + "\n".join(offenders)
    )


@pytest.mark.parametrize(
    "snippet",
    [
        "import torch.distributed as dist\ndist.distributed_c10d._get_default_group()",
        "import torch\nf = torch._C.Future",
        "import torch\ntorch._foreach_copy_(a, b)",
        "import torch\ntorch.distributed.distributed_c10d._world.pg_map",
        "from torch import distributed as dist\ndist._functional_collectives",
        "from torch.distributed import distributed_c10d as c10d\nc10d._rank_not_in_group(g)",
        "import torch.distributed as dist\n"
        "def f():\n    c10d = dist.distributed_c10d\n    c10d._store_based_barrier()",
        "import torch._dynamo",
        "import torch._C as C",
        "from torch._C import _distributed_c10d",
        "from torch._C._distributed_c10d import Work",
        "from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState",
        "from torch.distributed.elastic.agent.server import api\napi._RoleInstanceInfo",
        "from torch import _foreach_copy_",
        "from torch.nn.parallel import DistributedDataParallel as DDP\nDDP._get_ddp_logging_data",
        "import torch\ntorch.distributed.new_group()._get_backend(d)",
        "import torch\nx = torch.zeros(1)\nx._version",
        "import torch.distributed as dist\ngetattr(dist.distributed_c10d, '_world')",
        "import torch\nhasattr(torch, '_foreach_add_')",
        "import importlib\nimportlib.import_module('torch._dynamo')",
        "import torch\ntorch.distributed.elastic.agent.server.api._call_store = f",
        "from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler as H\n"
        "class Mine(H):\n    def _call_store(self, op):\n        return super()._call_store(op)",
    ],
)
def test_the_detector_finds(snippet):
    assert private_torch_uses(snippet), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        "import torch\ntorch.__version__",
        "import torch.distributed as dist\ndist.all_reduce(t)",
        "import torch\nself._bucket = torch.zeros(3)",
        "import torch\nmodel._reducer._buckets",
        "from torch.distributed.elastic.rendezvous import RendezvousHandler",
        "from dpscale.engine.compat import torch_private as tp\ntp._x",
        "import numpy as np\nnp._core",
        "getattr(obj, '_x')",
        "import torch\nclass M(torch.nn.Module):\n    def _forward(self):\n        return self._net",
        "class Mine(Base):\n    def _x(self):\n        return super()._x()",
    ],
)
def test_the_detector_lets_public_and_non_torch_names_pass(snippet):
    assert private_torch_uses(snippet) == [], snippet


def test_the_detector_names_line_and_expression():
    uses = private_torch_uses("import torch\n\n\ny = torch._C.Future\n")
    assert (4, "torch._C") in uses


def test_the_allowed_modules_are_where_the_layers_keep_them():
    # a renamed torch_private.py must be renamed here too, or every use in it becomes an offender
    # and the allow-list names a file that is gone
    layers = {Path(a).parts[0] for a in ALLOWED}
    assert layers == {"engine", "launch"}  # comm/ needs no private torch name today
    assert all((PACKAGE / a).is_file() for a in ALLOWED)
