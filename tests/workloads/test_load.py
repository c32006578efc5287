"""Loading a task by `module:callable`: what a module does at import is the same on every rank."""

import sys

import torch

from dpscale.workloads.load import load_task

# a task written as scripts are: the data drawn with torch's global RNG when the module is imported
SCRIPT_STYLE = """
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import dpscale

X, Y = torch.randn(32, 4), torch.randint(0, 2, (32,))


def make():
    return dpscale.Task(
        model=lambda: torch.nn.Linear(4, 2),
        train_data=TensorDataset(X, Y),
        loss=lambda out, y: F.cross_entropy(out, y, reduction="none"),
    )
"""


def test_data_drawn_at_import_is_the_same_whatever_the_rng_state_before(tmp_path, monkeypatch):
    (tmp_path / "script_style_task.py").write_text(SCRIPT_STYLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    drawn = []
    for state in (1, 2):  # each rank imports the module afresh, its RNG wherever it is
        monkeypatch.delitem(sys.modules, "script_style_task", raising=False)
        torch.manual_seed(state)
        task = load_task("script_style_task:make", seed=7)
        drawn.append(task.train_data.tensors[0])
        after = torch.rand(1)
        torch.manual_seed(state)
        assert torch.equal(after, torch.rand(1)), "loading a task moved the caller's RNG"
    assert torch.equal(drawn[0], drawn[1])
    monkeypatch.delitem(sys.modules, "script_style_task")
