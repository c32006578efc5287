"""benchmarks/archive/auto_batch_bound.py: the bound on what any growth rule could gain from given step
times and noise scales (no process)."""

import json
import math
import sys

import pytest


@pytest.fixture
def bound():
    import auto_batch_bound

    return auto_batch_bound


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
