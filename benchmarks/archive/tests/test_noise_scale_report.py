"""benchmarks/archive/noise_scale_report.py: medians over seeds, pooled noise scales, the predictions from
the runs at B, the fit, the error bands over seeds and the rate tuned per batch (no process)."""

import noise_scale_report as report
import pytest
from noise_scale_runs import seed_runs


def _runs(steps, noise=50.0, base=8):
    return [
        {"multiplier": k, "global_batch": k * base, "steps_to_target": s, "noise_scale": noise}
        for k, s in zip((1, 2, 4, 8, 16), steps, strict=True)
    ]


def test_predictions_follow_s_min_times_one_plus_b_noise_over_b():
    # S_min 10, B_noise 40: S(8) = 60, S(16) = 35, S(32) = 22.5, S(64) = 16.25, S(128) = 13.125
    rows = report.predictions(_runs([60, 35, 25, 16, None], noise=40.0))
    assert [r["predicted_steps"] for r in rows] == pytest.approx([60, 35, 22.5, 16.25, 13.125])
    assert rows[2]["error"] == pytest.approx(22.5 / 25 - 1) and rows[2]["within"] is True
    assert rows[4]["error"] is None and rows[4]["within"] is None  # missed: no error to form
    assert report.predictions(_runs([None, 35, 25, 16, 13]))[1]["predicted_steps"] is None


def test_fit_recovers_the_law_and_refuses_a_flat_or_short_series():
    s_min, b_noise = report.fitted(_runs([60, 35, 22.5, 16.25, 13.125]))
    assert (s_min, b_noise) == (pytest.approx(10.0), pytest.approx(40.0))
    assert report.fitted(_runs([10, None, None, None, None])) is None
    assert report.fitted(_runs([10, 12, 14, 16, 18])) is None  # steps growing with B: no law


def test_late_adam_and_two_point_predictions_come_from_the_same_runs():
    # S_min 10, B_noise 40 again; the run at B measured 20 over all its steps, 40 late in the run
    # and 40 in Adam's preconditioned norm
    runs = _runs([60, 35, 22.5, 16.25, 13.125], noise=20.0)
    runs[0]["late_noise_scale"] = runs[0]["adam_noise_scale"] = 40.0
    rows = report.predictions(runs)
    assert rows[2]["predicted_steps"] == pytest.approx(60 / 3.5 * 1.625)  # the pooled 20: too many
    assert [r["predicted_late"] for r in rows] == pytest.approx([60, 35, 22.5, 16.25, 13.125])
    assert [r["predicted_adam"] for r in rows] == pytest.approx([60, 35, 22.5, 16.25, 13.125])
    # B and 2B alone give S_min 2 x 35 - 60 = 10 and B_noise 2 x 8 x 25 / 10 = 40; 4B and beyond
    assert [r["predicted_fit2"] for r in rows[2:]] == pytest.approx([22.5, 16.25, 13.125])
    assert rows[0]["predicted_fit2"] is None and rows[1]["predicted_fit2"] is None
    assert rows[3]["error_fit2"] == pytest.approx(0.0) and rows[3]["within_fit2"] is True
    # no law when 2B took as many steps as B, or more; no Adam prediction without its noise scale
    assert report.two_point_law(_runs([30, 30, 20, 10, 5])) is None
    assert all(r["predicted_adam"] is None for r in report.predictions(_runs([60, 35, 22.5, 16, 13])))


def test_the_median_counts_a_miss_as_infinitely_many_steps():
    assert report.median_steps([30, None, 10]) == 30  # not 20: the miss is the largest
    assert report.median_steps([10, 20, 30, 40]) == 25
    assert report.median_steps([10, 20, None, None]) is None  # the middle pair holds a miss
    assert report.median_steps([10, None, None]) is None


def test_seeds_give_the_median_the_spread_and_the_pooled_noise_scales():
    runs = (
        seed_runs(0, [60, 30, 20, 10, None], trace=300.0, grad_sq=10.0, adam=(30.0, 3.0))
        + seed_runs(1, [80, 40, 30, 20, 12], trace=100.0, grad_sq=10.0, adam=(10.0, -1.0))
        + seed_runs(2, [70, 35, 25, 15, 11], trace=200.0, grad_sq=20.0, adam=(20.0, 2.0))
    )
    rows = report.aggregate(runs)
    first, last = rows[0], rows[-1]
    assert (first["steps_to_target"], first["min_steps"], first["max_steps"]) == (70, 60, 80)
    assert (last["steps_to_target"], last["missed"], last["seeds"]) == (12, 1, 3)
    # pooled: the sums of every seed's estimates divided, not the mean of the seeds' ratios (20)
    assert first["noise_scale"] == pytest.approx(600.0 / 40.0)
    assert first["adam_noise_scale"] == pytest.approx(60.0 / 4.0)
    assert first["late_noise_scale"] == pytest.approx((30 + 10 + 10) / 3)
    # one seed without Adam's sums (an SGD task): no Adam noise scale at all
    runs[5]["adam_trace_sum"] = runs[5]["adam_grad_sq_sum"] = None
    assert report.aggregate(runs)[0]["adam_noise_scale"] is None


def test_the_error_band_over_seeds_is_empty_when_every_seed_agrees_and_wide_when_they_do_not():
    same = [r for s in range(4) for r in seed_runs(s, [60, 35, 22.5, 16.25, 20], trace=400.0, grad_sq=10.0)]
    bands = report.error_bands(same, draws=50)
    assert bands[(4, "")] == pytest.approx((0.0, 0.0))
    assert bands[(16, "")][0] == pytest.approx(13.125 / 20 - 1)
    mixed = same[:10] + seed_runs(2, [60, 20, 10, 8, 5]) + seed_runs(3, [60, 50, 40, 30, 20])
    low, high = report.error_bands(mixed, draws=200)[(4, "")]
    assert low < -0.05 and high > 0.05
    shown = report.report(mixed)["t"]["rows"]
    assert shown[2]["band"] == (low, high)
    assert "[" in report.table(shown)


def test_the_rate_tuned_per_batch_keeps_the_factor_with_the_fewest_median_steps():
    def at(factor, steps, seeds=(0, 1, 2)):
        return [r | {"lr_factor": factor} for s in seeds for r in seed_runs(s, steps, trace=80.0)]

    runs = at(1.0, [60, 35, 25, 20, 18]) + at(2.0, [70, 30, 25, None, 12]) + at(0.5, [50, 40, 30, 19, 18])
    kept = report.tune(runs)
    chosen = {r["multiplier"]: r["lr_factor"] for r in kept}
    # fewest steps per batch; the tie at 4B (25 and 25) goes to 1, a miss never wins
    assert chosen == {1: 0.5, 2: 2.0, 4: 1.0, 8: 0.5, 16: 2.0}
    assert len(kept) == 5 * 3
    shown = report.report(runs)
    assert set(shown) == {"t", "t, rate tuned"}
    assert [r["steps_to_target"] for r in shown["t"]["rows"]] == [60, 35, 25, 20, 18]
    tuned = shown["t, rate tuned"]["rows"]
    assert [r["steps_to_target"] for r in tuned] == [50, 30, 25, 19, 12]
    # the prediction starts from the tuned S(B) = 50 and the noise scale of the runs chosen at B
    assert tuned[1]["predicted_steps"] == pytest.approx(50 / (1 + 8 / 8) * (1 + 8 / 16))
    assert "x 0.5" in report.table(tuned)
    one = at(1.0, [60, 35, 25, 20, 18])
    key = lambda r: (r["multiplier"], r["seed"])  # noqa: E731
    assert sorted(report.tune(one), key=key) == sorted(one, key=key)  # one factor: all kept


def test_the_steps_split_where_the_eval_loss_leaves_its_start():
    # eval loss 1.0 at the first evaluation: the start ends at the first one <= 0.9
    def run(seed, k, steps, curve):
        return seed_runs(seed, [steps] * 5)[0] | {
            "multiplier": k,
            "global_batch": 8 * k,
            "eval_losses": curve,
        }

    runs = [
        run(0, 1, 6, [(1, 1.0), (2, 0.95), (3, 0.91), (4, 0.9), (5, 0.3), (6, 0.1)]),  # start 4, drop 2
        run(1, 1, 10, [(1, 1.0), (4, 0.99), (8, 0.5), (9, 0.2), (10, 0.05)]),  # coarse: start 8, drop 2
        run(2, 1, None, [(1, 1.0), (2, 0.7)]),  # missed: no drop to count
        run(0, 2, 3, [(1, 1.2), (2, 1.05), (3, 0.1)]),  # 0.9 x 1.2 = 1.08: start 2
        run(1, 2, 2, [(1, 0.5), (2, 0.48)]),  # met a target above 0.9 x 0.5: no start to leave, left out
        seed_runs(3, [5] * 5)[0],  # no curve (an older file): left out
    ]
    rows = report.drop_split(runs)
    assert [(r["multiplier"], r["runs"]) for r in rows] == [(1, 2), (2, 1)]
    first = rows[0]
    assert (first["start"], first["start_range"], first["drop"], first["drop_range"]) == (
        6,
        (4, 8),
        2,
        (2, 2),
    )
    assert first["start_share"] == pytest.approx((4 / 6 + 8 / 10) / 2)
    assert (rows[1]["start"], rows[1]["drop"]) == (2, 1)
    assert "| 8 | 2 | 6 (4-8) | 2 (2-2) | 73% |" in report.drop_table(rows)
