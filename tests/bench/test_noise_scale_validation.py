"""benchmarks/noise_scale_validation.py's arithmetic: medians over seeds, pooled noise scales, the
predictions from the runs at B, Adam's preconditioner and the evaluation schedule (no process)."""

import json
import math
import sys
import types

import pytest
import torch

from support.benchmark_module import BENCHMARKS, load_benchmark

validation = load_benchmark(BENCHMARKS / "noise_scale_validation.py", "noise_scale_validation")


def _runs(steps, noise=50.0, base=8):
    return [
        {"multiplier": k, "global_batch": k * base, "steps_to_target": s, "noise_scale": noise}
        for k, s in zip((1, 2, 4, 8, 16), steps, strict=True)
    ]


def _seed_runs(seed, steps, *, trace=400.0, grad_sq=10.0, adam=None, base=8):
    """One seed's runs as _train_seed returns them (sums over the run's steps)."""
    return [
        {
            "task": "t",
            "seed": seed,
            "multiplier": k,
            "global_batch": k * base,
            "steps_to_target": s,
            "coarse_hit": False,
            "trace_sum": trace,
            "grad_sq_sum": grad_sq,
            "late_noise_scale": trace / grad_sq,
            "adam_trace_sum": None if adam is None else adam[0],
            "adam_grad_sq_sum": None if adam is None else adam[1],
            "mean_gain": 1.0,
            "wall_s": 0.0,
        }
        for k, s in zip((1, 2, 4, 8, 16), steps, strict=True)
    ]


def test_predictions_follow_s_min_times_one_plus_b_noise_over_b():
    # S_min 10, B_noise 40: S(8) = 60, S(16) = 35, S(32) = 22.5, S(64) = 16.25, S(128) = 13.125
    rows = validation.predictions(_runs([60, 35, 25, 16, None], noise=40.0))
    assert [r["predicted_steps"] for r in rows] == pytest.approx([60, 35, 22.5, 16.25, 13.125])
    assert rows[2]["error"] == pytest.approx(22.5 / 25 - 1) and rows[2]["within"] is True
    assert rows[4]["error"] is None and rows[4]["within"] is None  # missed: no error to form
    assert validation.predictions(_runs([None, 35, 25, 16, 13]))[1]["predicted_steps"] is None


def test_fit_recovers_the_law_and_refuses_a_flat_or_short_series():
    s_min, b_noise = validation.fitted(_runs([60, 35, 22.5, 16.25, 13.125]))
    assert (s_min, b_noise) == (pytest.approx(10.0), pytest.approx(40.0))
    assert validation.fitted(_runs([10, None, None, None, None])) is None
    assert validation.fitted(_runs([10, 12, 14, 16, 18])) is None  # steps growing with B: no law


def test_late_adam_and_two_point_predictions_come_from_the_same_runs():
    # S_min 10, B_noise 40 again; the run at B measured 20 over all its steps, 40 late in the run
    # and 40 in Adam's preconditioned norm
    runs = _runs([60, 35, 22.5, 16.25, 13.125], noise=20.0)
    runs[0]["late_noise_scale"] = runs[0]["adam_noise_scale"] = 40.0
    rows = validation.predictions(runs)
    assert rows[2]["predicted_steps"] == pytest.approx(60 / 3.5 * 1.625)  # the pooled 20: too many
    assert [r["predicted_late"] for r in rows] == pytest.approx([60, 35, 22.5, 16.25, 13.125])
    assert [r["predicted_adam"] for r in rows] == pytest.approx([60, 35, 22.5, 16.25, 13.125])
    # B and 2B alone give S_min 2 x 35 - 60 = 10 and B_noise 2 x 8 x 25 / 10 = 40; 4B and beyond
    assert [r["predicted_fit2"] for r in rows[2:]] == pytest.approx([22.5, 16.25, 13.125])
    assert rows[0]["predicted_fit2"] is None and rows[1]["predicted_fit2"] is None
    assert rows[3]["error_fit2"] == pytest.approx(0.0) and rows[3]["within_fit2"] is True
    # no law when 2B took as many steps as B, or more; no Adam prediction without its noise scale
    assert validation.two_point_law(_runs([30, 30, 20, 10, 5])) is None
    assert all(r["predicted_adam"] is None for r in validation.predictions(_runs([60, 35, 22.5, 16, 13])))


def test_the_median_counts_a_miss_as_infinitely_many_steps():
    assert validation.median_steps([30, None, 10]) == 30  # not 20: the miss is the largest
    assert validation.median_steps([10, 20, 30, 40]) == 25
    assert validation.median_steps([10, 20, None, None]) is None  # the middle pair holds a miss
    assert validation.median_steps([10, None, None]) is None


def test_seeds_give_the_median_the_spread_and_the_pooled_noise_scales():
    runs = (
        _seed_runs(0, [60, 30, 20, 10, None], trace=300.0, grad_sq=10.0, adam=(30.0, 3.0))
        + _seed_runs(1, [80, 40, 30, 20, 12], trace=100.0, grad_sq=10.0, adam=(10.0, -1.0))
        + _seed_runs(2, [70, 35, 25, 15, 11], trace=200.0, grad_sq=20.0, adam=(20.0, 2.0))
    )
    rows = validation.aggregate(runs)
    first, last = rows[0], rows[-1]
    assert (first["steps_to_target"], first["min_steps"], first["max_steps"]) == (70, 60, 80)
    assert (last["steps_to_target"], last["missed"], last["seeds"]) == (12, 1, 3)
    # pooled: the sums of every seed's estimates divided, not the mean of the seeds' ratios (20)
    assert first["noise_scale"] == pytest.approx(600.0 / 40.0)
    assert first["adam_noise_scale"] == pytest.approx(60.0 / 4.0)
    assert first["late_noise_scale"] == pytest.approx((30 + 10 + 10) / 3)
    # one seed without Adam's sums (an SGD task): no Adam noise scale at all
    runs[5]["adam_trace_sum"] = runs[5]["adam_grad_sq_sum"] = None
    assert validation.aggregate(runs)[0]["adam_noise_scale"] is None


def test_the_error_band_over_seeds_is_empty_when_every_seed_agrees_and_wide_when_they_do_not():
    same = [r for s in range(4) for r in _seed_runs(s, [60, 35, 22.5, 16.25, 20], trace=400.0, grad_sq=10.0)]
    bands = validation.error_bands(same, draws=50)
    assert bands[(4, "")] == pytest.approx((0.0, 0.0))
    assert bands[(16, "")][0] == pytest.approx(13.125 / 20 - 1)
    mixed = same[:10] + _seed_runs(2, [60, 20, 10, 8, 5]) + _seed_runs(3, [60, 50, 40, 30, 20])
    low, high = validation.error_bands(mixed, draws=200)[(4, "")]
    assert low < -0.05 and high > 0.05
    shown = validation.report(mixed)["t"]["rows"]
    assert shown[2]["band"] == (low, high)
    assert "[" in validation.table(shown)


def test_the_adam_preconditioner_is_the_one_adamw_divides_its_step_by():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    opt = torch.optim.AdamW([p], lr=0.1, betas=(0.0, 0.9), eps=1e-3, weight_decay=0.0)
    assert validation.adam_preconditioner(opt, [p]) is None  # no second moments yet
    for _ in range(3):
        before, p.grad = p.detach().clone(), torch.randn(5)
        opt.step()
    # beta1 = 0: the step is -lr x g x P with P from the second moments including this step's g
    (weights,) = validation.adam_preconditioner(opt, [p])
    assert p.detach() - before == pytest.approx(-0.1 * p.grad * weights, rel=1e-5)
    sgd = torch.optim.SGD([p], lr=0.1)
    assert validation.adam_preconditioner(sgd, [p]) is None


def test_the_preconditioned_noise_is_the_micro_batch_against_the_step_in_adams_norm():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    task = types.SimpleNamespace(
        collate=lambda items: (torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])),
        loss=lambda out, target: ((out - target) ** 2).sum(dim=1),
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model.weight.grad = torch.tensor([[1.0, 4.0, 0.25]])  # P = 1, 1/4, 4: unlike the plain norm
    opt.step()  # second moments to weight by
    loss = task.loss(model(x), y).mean()
    (full,) = torch.autograd.grad(loss, [model.weight])
    model.weight.grad = full.clone()  # the accumulated step gradient, as after the reduction
    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(module=model),
        optimizer=opt,
        task=task,
        train_data=list(zip(x, y, strict=True)),
        device=torch.device("cpu"),
        state=types.SimpleNamespace(global_batch=8),
    )
    meter = validation.PreconditionedNoise()
    meter.on_batch(trainer, types.SimpleNamespace(micro_batches=[[0, 1, 2, 3], [4, 5, 6, 7]]))
    meter.after_reduce(trainer, [model.weight.grad])
    (w,) = validation.adam_preconditioner(opt, [model.weight])
    (micro,) = torch.autograd.grad(task.loss(model(x[:4]), y[:4]).mean(), [model.weight])
    small, big = float((w * micro**2).sum()), float((w * full**2).sum())
    assert meter.estimator.state_dict()["grad_sq_sum"] == pytest.approx((8 * big - 4 * small) / 4)
    assert meter.estimator.state_dict()["trace_sum"] == pytest.approx((small - big) / (1 / 4 - 1 / 8))
    assert torch.equal(model.weight.grad, full)  # the optimizer's gradient is left alone


def test_evaluation_is_coarse_far_from_the_target_and_every_step_near_it():
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
    jump = validation.FirstReach(0.5, coarse_every=4)
    jump._last = (4, 5.0)  # straight from above 2x the target to it: flagged
    trainer.step, trainer.total_steps, losses = 8, 100, iter([0.4])
    jump.after_step(trainer)
    assert jump.reached_at == 8 and jump.coarse_hit is True
    exact, trainer.step, losses = validation.FirstReach(0.5), 1, iter([5.0])
    exact.after_step(trainer)  # by default after every step, however far from the target
    assert evaluated[-1] == 1 and math.isinf(validation.FirstReach(0.5)._last[1])


def test_the_rate_tuned_per_batch_keeps_the_factor_with_the_fewest_median_steps():
    def at(factor, steps, seeds=(0, 1, 2)):
        return [r | {"lr_factor": factor} for s in seeds for r in _seed_runs(s, steps, trace=80.0)]

    runs = at(1.0, [60, 35, 25, 20, 18]) + at(2.0, [70, 30, 25, None, 12]) + at(0.5, [50, 40, 30, 19, 18])
    kept = validation.tune(runs)
    chosen = {r["multiplier"]: r["lr_factor"] for r in kept}
    # fewest steps per batch; the tie at 4B (25 and 25) goes to 1, a miss never wins
    assert chosen == {1: 0.5, 2: 2.0, 4: 1.0, 8: 0.5, 16: 2.0}
    assert len(kept) == 5 * 3
    shown = validation.report(runs)
    assert set(shown) == {"t", "t, rate tuned"}
    assert [r["steps_to_target"] for r in shown["t"]["rows"]] == [60, 35, 25, 20, 18]
    tuned = shown["t, rate tuned"]["rows"]
    assert [r["steps_to_target"] for r in tuned] == [50, 30, 25, 19, 12]
    # the prediction starts from the tuned S(B) = 50 and the noise scale of the runs chosen at B
    assert tuned[1]["predicted_steps"] == pytest.approx(50 / (1 + 8 / 8) * (1 + 8 / 16))
    assert "x 0.5" in validation.table(tuned)
    one = at(1.0, [60, 35, 25, 20, 18])
    key = lambda r: (r["multiplier"], r["seed"])  # noqa: E731
    assert sorted(validation.tune(one), key=key) == sorted(one, key=key)  # one factor: all kept


def test_render_joins_files_of_other_rate_factors_and_refuses_a_run_given_twice(
    tmp_path, monkeypatch, capsys
):
    def dump(name, runs):
        path = tmp_path / name
        path.write_text(json.dumps({"runs": runs}))
        return str(path)

    one = dump(
        "one.json", [r | {"lr_factor": 1.0} for s in range(3) for r in _seed_runs(s, [60, 35, 25, 20, 18])]
    )
    two = dump(
        "two.json", [r | {"lr_factor": 2.0} for s in range(3) for r in _seed_runs(s, [50, 30, 25, 19, 12])]
    )
    monkeypatch.setattr(sys, "argv", ["noise_scale_validation.py", "--render", one, two])
    validation.main()
    assert "t, rate tuned: best fit" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["noise_scale_validation.py", "--render", one, one])
    with pytest.raises(SystemExit) as exit_:
        validation.main()
    assert exit_.value.code == 2 and "twice" in capsys.readouterr().err


def test_every_step_evaluates_the_transformer_after_every_step_too(monkeypatch):
    specs = []

    def fake_run_ranks(fn, world, spec, multipliers, seed, factor, timeout_s):
        specs.append(spec)
        return [
            [r | {"task": spec.name, "lr_factor": factor} for r in _seed_runs(seed, [60, 35, 25, 20, 18])]
        ]

    monkeypatch.setattr(validation, "run_ranks", fake_run_ranks)
    argv = ["noise_scale_validation.py", "--tasks", "transformer", "--seeds", "0,1"]
    monkeypatch.setattr(sys, "argv", argv)
    validation.main()
    monkeypatch.setattr(sys, "argv", [*argv, "--every-step"])
    validation.main()
    assert [s.coarse_every for s in specs] == [4, 4, 1, 1]
