"""Torch's private surface: in one module per layer, each use checked against the running torch."""

from __future__ import annotations

import pytest
import torch

from dpscale.engine.compat import torch_private
from dpscale.engine.compat.torch_private import TorchPrivateError, lookup
from dpscale.engine.grad_pool import GradPool


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
