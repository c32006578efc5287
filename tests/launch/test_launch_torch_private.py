"""torch's private surface in launch/ lives in torch_private.py, and each use there is checked."""

import ast
from pathlib import Path

import pytest
import torch

import dpscale
from dpscale.launch import torch_private

PACKAGE = Path(dpscale.__file__).parent
LAUNCH = PACKAGE / "launch"
# private names of the standard library, not torch's
_STDLIB = {"_exit", "_getframe", "_forkserver"}  # multiprocessing.forkserver's server (fork_start.py)
# what a fresh interpreter does at its end, and its main process, for a forked script (script_main.py)
_STDLIB |= {"_run_exitfuncs", "_clear", "_identity", "_parent_process", "_xoptions"}


def _defined_in_dpscale() -> set[str]:
    """Every leading-underscore name dpscale itself defines (functions, classes, attributes)."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
    return {n for n in names if n.startswith("_")}


def _private_uses(path: Path, ours: set[str]) -> list[str]:
    uses = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name in _torch_private_names():  # an override
            uses.append(f"{path.name}:{node.lineno}: def {node.name}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if node.attr not in ours and node.attr not in _STDLIB:
                uses.append(f"{path.name}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            private = [n.name for n in node.names if n.name.startswith("_")]
            if private or any(part.startswith("_") for part in node.module.split(".")):
                uses.append(f"{path.name}:{node.lineno}: from {node.module} import {private}")
    return uses


def test_no_private_torch_name_in_launch_outside_torch_private():
    ours = _defined_in_dpscale() - _torch_private_names()
    files = [p for p in sorted(LAUNCH.glob("*.py")) if p.name != "torch_private.py"]
    found = [use for path in files for use in _private_uses(path, ours)]
    assert not found, found


def _torch_private_names() -> set[str]:
    """The private torch names torch_private.py reaches (so that assigning one elsewhere is caught too)."""
    tree = ast.parse(Path(torch_private.__file__).read_text())
    return {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
    } | {"_call_store", "_create_tcp_store_server", "_state_holder", "_settings", "_this_node"}


def test_the_grep_sees_a_private_torch_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(handler):\n    return handler._state_holder.state\n")
    assert _private_uses(bad, _defined_in_dpscale() - _torch_private_names()) == ["bad.py:2: ._state_holder"]


def test_a_missing_private_attribute_fails_in_one_line_naming_torch_and_the_feature():
    with pytest.raises(torch_private.TorchPrivateError) as err:
        torch_private.rendezvous_round(object())
    message = str(err.value)
    assert "\n" not in message
    assert f"torch {torch.__version__}" in message and "attempt number" in message


def test_the_running_torch_has_what_the_launcher_reaches():
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    torch_private._handler_class_checked()
    torch_private._backend_store_calls_checked()
    assert isinstance(DynamicRendezvousHandler.settings, property)
    assert callable(torch_private.default_store)
