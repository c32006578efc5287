"""Torch's private surface: in one module per layer, each use checked against the running torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from dpscale.engine.compat import torch_private
from dpscale.engine.compat.torch_private import TorchPrivateError, lookup
from dpscale.engine.grad_pool import GradPool

SRC = Path(__file__).resolve().parents[2] / "src" / "dpscale"
# the layers held to it here, and the one module in each allowed a private torch name
LAYERS = {"engine": "engine/compat/torch_private.py", "comm": "comm/torch_private.py"}


def test_a_missing_attribute_is_one_line_naming_torch_and_the_feature():
    with pytest.raises(TorchPrivateError) as err:
        lookup(torch._C, "_no_such_thing_in_any_torch", "frobnicating the buckets")
    message = str(err.value)
    assert "\n" not in message
    assert torch.__version__ in message and "frobnicating the buckets" in message
    assert "_no_such_thing_in_any_torch" in message


def test_an_attribute_of_the_wrong_shape_is_refused_alike():
    with pytest.raises(TorchPrivateError, match="not_callable"):
        lookup(torch, "__version__", "not_callable feature")  # a string, not callable
    assert lookup(torch, "zeros", "x") is torch.zeros
    assert lookup(torch.autograd, "Variable._execution_engine", "x", expect=lambda e: True) is not None


def test_join_config_missing_is_one_line():
    with pytest.raises(TorchPrivateError, match="_join_config") as err:
        torch_private.join_enabled(object())
    assert "\n" not in str(err.value)


def test_the_fallbacks_give_torchs_public_behaviour(monkeypatch):
    monkeypatch.setattr(torch_private, "_foreach_copy", lambda: None)
    dst, src = [torch.zeros(3), torch.zeros(2)], [torch.arange(3.0), torch.ones(2)]
    torch_private.foreach_copy_(dst, src)
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
    # without the storage count a pool is never taken as free: a fresh one each step, never a
    # buffer someone still holds
    buffer = torch.zeros(4)
    pool = GradPool(buffer, [0, 2], [buffer[:2], buffer[2:]])
    assert pool.free()
    monkeypatch.setattr(torch_private, "_storage_use_count", lambda: None)
    assert torch_private.storage_use_count(buffer) is None
    assert not pool.free()


def private_torch_names(path: Path) -> list[str]:
    """`file:line: name` for each private torch module or attribute `path` uses."""
    tree = ast.parse(path.read_text(), filename=str(path))
    roots, found = {"torch"}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    roots.add((alias.asname or alias.name).split(".")[0])
                    if any(part.startswith("_") for part in alias.name.split(".")):
                        found.append(f"{path}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            module = node.module or ""
            for alias in node.names:
                roots.add(alias.asname or alias.name)
                if alias.name.startswith("_") or any(part.startswith("_") for part in module.split(".")):
                    found.append(f"{path}:{node.lineno}: from {module} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in roots:
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_scanner_sees_private_names(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch._C import Future\n"
        "torch._foreach_copy_\ndist.distributed_c10d._get_default_group()\ntorch.zeros\n"
    )
    assert len(private_torch_names(probe)) == 3


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_no_private_torch_name_outside_the_layers_one_module(layer):
    allowed = SRC / LAYERS[layer]
    found = [
        hit
        for path in sorted((SRC / layer).rglob("*.py"))
        if path != allowed
        for hit in private_torch_names(path)
    ]
    assert not found, f"move these into {LAYERS[layer]} (an accessor checked on first use): {found}"
