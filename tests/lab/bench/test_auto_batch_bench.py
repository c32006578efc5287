"""benchmarks/auto_batch.py's arithmetic: the comparison with the best fixed batch, seed by seed (the
bound on what any growth rule could gain is archived: benchmarks/archive/tests/test_auto_batch_bound.py)."""

import json
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
