"""The lab's view of a task (Recipe): one spec, the same batches and loss in every command."""

from pathlib import Path

import pytest
import torch

from dpscale.lab.predict.bare import bare_model
from dpscale.lab.recipe import load_recipe


@pytest.fixture(autouse=True)
def check_models_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent / "check"))  # check_models.py


def test_dict_inputs_are_drawn_split_and_fed_and_the_loss_is_a_per_sample_sum():
    recipe = load_recipe("check_models:dict_inputs", check=True)
    x, y = recipe.make_batch(8, torch.Generator().manual_seed(0))
    assert set(x) == {"a", "b"} and x["a"].shape == (8, 4) and y.shape == (8,)
    xm, ym = recipe.take(x, y, slice(2, 5))
    assert xm["b"].shape == (3, 2) and torch.equal(ym, y[2:5])
    model = recipe.build_model()
    out = recipe.forward(model, x)
    per_sample = torch.nn.functional.cross_entropy(out, y, reduction="none")
    torch.testing.assert_close(recipe.loss(out, y), per_sample.sum())


def test_predicts_bare_model_steps_a_user_task():
    bare = bare_model("check_models:dict_inputs", 8, rank=0)
    before = [p.detach().clone() for p in bare.model.parameters()]
    bare.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, bare.model.parameters(), strict=True))


def test_a_bare_module_is_not_a_task_anywhere():
    with pytest.raises(
        ValueError, match="^--model: dpscale.workloads.models:DigitsNet\\(\\) returned DigitsNet"
    ):
        load_recipe("dpscale.workloads.models:DigitsNet")
