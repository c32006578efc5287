"""benchmarks/auto_batch.py's arithmetic: the comparison with the best fixed batch, seed by seed,
and the bound on what any growth rule could gain from given step times and noise scales."""

import json
import math
import sys

import pytest

from support.benchmark_module import BENCHMARKS, load_benchmark

bench = load_benchmark(BENCHMARKS / "auto_batch.py", "auto_batch_bench")


def test_each_variant_is_divided_by_the_best_fixed_batch_with_the_same_seed():
    times = {
        "fixed x1": {0: 1.0, 1: 2.0, 2: 3.0},
        "fixed x2": {0: 0.5, 1: 3.0, 2: 4.0},  # faster on seed 0, slower in the median
        "auto": {0: 0.5, 2: 3.3},  # missed the target with seed 1
    }
    best, ratios = bench.ratios_to_best_fixed(times)
    assert best == "fixed x1"
    assert ratios["fixed x1"] == [1.0, 1.0, 1.0]
    assert ratios["fixed x2"] == pytest.approx([0.5, 1.5, 4 / 3])
    assert ratios["auto"] == pytest.approx([0.5, 1.1])


def test_step_times_proportional_to_the_batch_leave_growth_nothing_to_gain():
    # time to target ~ (1 + B_noise / B) x m B = m (B + B_noise): the smallest batch wins at every
    # noise scale, so the oracle schedule is the smallest fixed batch
    fixed, oracle = bench.oracle_times({1: 1.0, 2: 2.0, 4: 4.0}, base=8, noise=bench.linear_noise(1.0, 500.0))
    assert min(fixed, key=fixed.get) == 1 and oracle == pytest.approx(1.0)
    assert fixed[2] > 1.0


def test_an_overhead_bound_step_and_a_growing_noise_scale_let_growth_win():
    # the cost of a step is mostly fixed, and the noise scale grows 100x: small batches early,
    # large late beat any one batch
    times = {1: 1.0, 2: 1.2, 4: 1.6, 8: 2.4}
    fixed, oracle = bench.oracle_times(times, base=8, noise=bench.linear_noise(2.0, 200.0))
    assert min(fixed.values()) == 1.0 and oracle < 0.99
    # a noise scale that stays put: one batch is best throughout, the oracle only ties it
    _, still = bench.oracle_times(times, base=8, noise=bench.linear_noise(20.0, 20.0))
    assert still == pytest.approx(1.0)


def test_a_run_where_no_fixed_batch_reached_the_target_is_kept_and_rendered(tmp_path, monkeypatch, capsys):
    # the JSON is written before anything is rendered: a run of up to an hour is never lost to a
    # table that has no best fixed batch to divide by
    def row(variant, reached):
        return {
            "task": "digits",
            "variant": variant,
            "round": 0,
            "reached": reached,
            "steps": 12 if reached else None,
            "time_to_target_s": 0.1 if reached else None,
            "final_global_batch": 32,
            "step_k": [1] * 12,
            "step_ms": [5.0] * 12,
            "gns": [20.0] * 12,
        }

    rows = [row(f"fixed x{k}", False) for k in bench.FIXED] + [row(v, v == "auto") for v in bench.AUTO]
    monkeypatch.setattr(bench, "run_ranks", lambda *args, **kwargs: [rows])
    out = tmp_path / "rows.json"
    monkeypatch.setattr(
        sys, "argv", ["auto_batch.py", "--tasks", "digits", "--rounds", "1", "--json", str(out)]
    )
    bench.main()
    assert json.loads(out.read_text()) == rows
    shown = capsys.readouterr().out
    assert "| digits | auto | 1/1 | 12 | 0.10 |" in shown and "no oracle bound" in shown


@pytest.fixture
def bound(monkeypatch):
    return load_benchmark(BENCHMARKS / "auto_batch_bound.py", "auto_batch_bound", monkeypatch)


def test_a_lost_gradient_counts_as_an_infinite_noise_scale_and_makes_no_progress(bound):
    # the smoothed |G|^2 not positive (None) after the first steps: the gradient is lost in its
    # noise, a step there makes no progress at any batch; the first steps' estimates are not used
    gns = [None, 5.0, 10.0, 20.0, None, None, 30.0]
    noise = bound.running_noise(gns, window=0, first=1)
    assert math.isnan(noise[0]) and noise[1:4] == [5.0, 10.0, 20.0] and noise[4] == math.inf
    noise_near = bound.running_noise(gns, window=1, first=1)
    assert math.isnan(noise_near[0]) and noise_near[5] == math.inf  # median of 20, inf, inf
    shares = bound.shares_of_the_way(noise, 10)
    assert shares[:4] == [0.0, pytest.approx(2 / 3), 0.5, pytest.approx(1 / 3)] and shares[4] == 0.0


def test_the_bound_over_machines_finds_growth_only_where_the_noise_scale_grows(bound):
    steady = [50.0] * 200
    flat = bound.bound(steady, bound.shares_of_the_way(steady, 32), base=32)
    assert set(flat) == set(bound.FIXED_COSTS)
    assert all(ratio == pytest.approx(1.0) for _, ratio in flat.values())
    # a large fixed cost makes a larger fixed batch best
    assert flat[256][0] > flat[0.25][0]
    growing = [50.0 * 1.03**i for i in range(200)]  # 50 -> ~18,000 samples
    grown = bound.bound(growing, bound.shares_of_the_way(growing, 32), base=32)
    assert min(ratio for _, ratio in grown.values()) < 0.9


def test_the_table_measures_the_way_to_the_lowest_eval_loss(bound):
    run = {
        "task": "digits",
        "seed": 0,
        "global_batch": 32,
        "evals": [
            {"step": s, "samples": 32 * s, "loss": loss} for s, loss in ((24, 0.5), (40, 0.1), (56, 0.2))
        ],
        "gns": [32.0] * 60,
        "step_ms": [5.0] * 60,
    }
    rows = bound.render(run, window=2)
    # the first 8 steps' estimates are not used: the way starts at step 9
    assert rows[3].startswith("| 24 | 768 | 0.5000 | 32 | 0.50 | 1.000 ")
    assert rows[4].startswith("| 40 | 1280 | 0.1000 | 32 | 1.00 |")  # the lowest: the whole way
    assert rows[5].startswith("| 56 | 1792 | 0.2000 | 32 | 1.50 |")
    # measured step times: the oracle gets the line through them, not their wobbles
    rows = bound.render(run, window=2, step_ms={1: 10.0, 2: 11.0, 4: 13.0, 8: 17.0})
    assert "at t(k) = 9.0 + 1.00 k ms" in rows[1]
    assert rows[4].endswith("| 1.000 (4) |")  # B_noise 32: t (1 + 32 / 32k) is least at k = 4


def test_the_step_time_line_ignores_which_k_a_wobble_made_cheap(bound):
    c, m = bound.fit_line({1: 20.0, 2: 21.0, 4: 23.0, 8: 27.0})
    assert (c, m) == (pytest.approx(19.0), pytest.approx(1.0))
    # k = 2 measured 3 ms too slow: the line moves a little, it does not single k = 2 out
    c2, m2 = bound.fit_line({1: 20.0, 2: 24.0, 4: 23.0, 8: 27.0})
    assert 19.0 < c2 + m2 * 2 < 24.0
    with pytest.raises(ValueError, match="--step-ms"):
        bound.fit_line({1: 20.0})


def test_measure_over_a_link_goes_to_the_emulated_hosts_and_prints_what_step_ms_takes(
    bound, monkeypatch, capsys, tmp_path
):
    calls = []

    def over_link(task, rate_gbit, ks, steps):
        calls.append((task, rate_gbit, ks))
        return {k: 17.0 + k for k in ks}

    monkeypatch.setattr(bound, "_measure_over_link", over_link)
    monkeypatch.setattr(bound, "run_ranks", lambda *a, **k: pytest.fail("not on this host"))
    monkeypatch.setattr(sys, "argv", ["x", "--task", "digits", "--measure", "gloo", "--rate-gbit", "0.1"])
    bound.main()
    assert calls == [("digits", 0.1, [1, 2, 4, 8, 16])]
    printed = capsys.readouterr().out.strip()
    assert printed == "1=18.00,2=19.00,4=21.00,8=25.00,16=33.00"
    # ... in the form --step-ms reads back
    run = tmp_path / "run.json"
    evals = [{"step": 40, "samples": 1280, "loss": 0.1}]
    run.write_text(
        json.dumps(
            {
                "task": "digits",
                "seed": 0,
                "global_batch": 32,
                "evals": evals,
                "gns": [32.0] * 40,
                "step_ms": [5.0] * 40,
            }
        )
    )
    monkeypatch.setattr(sys, "argv", ["x", "--render", str(run), "--step-ms", printed])
    bound.main()
    assert "at t(k) = 17.0 + 1.00 k ms" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["x", "--render", str(run), "--step-ms", "1=x"])
    with pytest.raises(SystemExit):
        bound.main()
    assert "--step-ms: give K=MS" in capsys.readouterr().err
