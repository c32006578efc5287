"""benchmarks/archive/noise_scale_validation.py: the evaluation schedule and the options (no process;
its arithmetic is test_noise_scale_report.py's, Adam's test_noise_scale_adam.py's)."""

import json
import math
import sys
import types

import pytest
from noise_scale_runs import seed_runs


@pytest.fixture
def validation():
    # imported as `python benchmarks/archive/noise_scale_validation.py` runs it, with its folder on
    # sys.path (conftest.py): the script imports its siblings noise_scale_report and noise_scale_adam
    import noise_scale_validation

    return noise_scale_validation


def test_evaluation_is_coarse_far_from_the_target_and_every_step_near_it(validation):
    losses = iter([5.0, 0.8, 0.55, 0.45])  # target 0.5: 2x is 1.0
    evaluated = []

    class FakeTrainer:
        step, total_steps = 0, 100
        noise_scale = types.SimpleNamespace(b_simple=7.0)

        def evaluate(self):
            evaluated.append(self.step)
            return {"loss": next(losses)}

    trainer, reach = FakeTrainer(), validation.FirstReach(0.5, coarse_every=4)
    while trainer.step < trainer.total_steps:
        trainer.step += 1
        reach.after_step(trainer)
    assert evaluated == [4, 8, 9, 10]  # every 4 steps above 1.0, every step below
    assert (reach.reached_at, trainer.total_steps, reach.late_noise_scale) == (10, 10, 7.0)
    assert reach.coarse_hit is False
    assert reach.curve == [(4, 5.0), (8, 0.8), (9, 0.55), (10, 0.45)]  # every evaluation, kept
    jump = validation.FirstReach(0.5, coarse_every=4)
    jump._last = (4, 5.0)  # straight from above 2x the target to it: flagged
    trainer.step, trainer.total_steps, losses = 8, 100, iter([0.4])
    jump.after_step(trainer)
    assert jump.reached_at == 8 and jump.coarse_hit is True
    exact, trainer.step, losses = validation.FirstReach(0.5), 1, iter([5.0])
    exact.after_step(trainer)  # by default after every step, however far from the target
    assert evaluated[-1] == 1 and math.isinf(validation.FirstReach(0.5)._last[1])


def test_render_joins_files_of_other_rate_factors_and_refuses_a_run_given_twice(
    validation, tmp_path, monkeypatch, capsys
):
    def dump(name, runs):
        path = tmp_path / name
        path.write_text(json.dumps({"runs": runs}))
        return str(path)

    one = dump(
        "one.json", [r | {"lr_factor": 1.0} for s in range(3) for r in seed_runs(s, [60, 35, 25, 20, 18])]
    )
    curve = [(1, 1.0), (5, 0.5), (12, 0.1)]  # the files of this version keep each run's eval losses
    two = dump(
        "two.json",
        [
            r | {"lr_factor": 2.0, "eval_losses": curve}
            for s in range(3)
            for r in seed_runs(s, [50, 30, 25, 19, 12])
        ],
    )
    monkeypatch.setattr(sys, "argv", ["noise_scale_validation.py", "--render", one, two])
    validation.main()
    out = capsys.readouterr().out
    assert "t, rate tuned: best fit" in out
    assert "t, rate x2: where the steps go" in out and "t, rate x1: where" not in out  # one has none
    monkeypatch.setattr(sys, "argv", ["noise_scale_validation.py", "--render", one, one])
    with pytest.raises(SystemExit) as exit_:
        validation.main()
    assert exit_.value.code == 2 and "twice" in capsys.readouterr().err


def test_every_step_evaluates_the_transformer_after_every_step_too(validation, monkeypatch):
    specs = []

    def fake_run_ranks(fn, world, spec, multipliers, seed, factor, hessian_at, timeout_s):
        assert hessian_at == (1,)  # the Hessian noise scale at B only, by default
        specs.append(spec)
        return [[r | {"task": spec.name, "lr_factor": factor} for r in seed_runs(seed, [60, 35, 25, 20, 18])]]

    monkeypatch.setattr(validation, "run_ranks", fake_run_ranks)
    argv = ["noise_scale_validation.py", "--tasks", "transformer", "--seeds", "0,1"]
    monkeypatch.setattr(sys, "argv", argv)
    validation.main()
    monkeypatch.setattr(sys, "argv", [*argv, "--every-step"])
    validation.main()
    assert [s.coarse_every for s in specs] == [4, 4, 1, 1]
