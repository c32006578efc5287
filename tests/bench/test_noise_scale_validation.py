"""benchmarks/noise_scale_validation.py's arithmetic: the prediction from the run at B, and the fit."""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "noise_scale_validation.py"
_spec = importlib.util.spec_from_file_location("noise_scale_validation", _PATH)
validation = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = validation  # its dataclasses look their module up while being defined
_spec.loader.exec_module(validation)


def _runs(steps, noise=50.0, base=8):
    return [
        {"multiplier": k, "global_batch": k * base, "steps_to_target": s, "noise_scale": noise}
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


def test_late_noise_scale_and_two_point_fit_predict_from_the_same_runs():
    # S_min 10, B_noise 40 again; the run at B measured 20 over all its steps, 40 late in the run
    runs = _runs([60, 35, 22.5, 16.25, 13.125], noise=20.0)
    runs[0]["late_noise_scale"] = 40.0
    rows = validation.predictions(runs)
    assert rows[2]["predicted_steps"] == pytest.approx(60 / 3.5 * 1.625)  # the pooled 20: too many
    assert [r["predicted_late"] for r in rows] == pytest.approx([60, 35, 22.5, 16.25, 13.125])
    # B and 2B alone give S_min 2 x 35 - 60 = 10 and B_noise 2 x 8 x 25 / 10 = 40; 4B and beyond
    assert [r["predicted_fit2"] for r in rows[2:]] == pytest.approx([22.5, 16.25, 13.125])
    assert rows[0]["predicted_fit2"] is None and rows[1]["predicted_fit2"] is None
    assert rows[3]["error_fit2"] == pytest.approx(0.0) and rows[3]["within_fit2"] is True
    # no law when 2B took as many steps as B, or more
    assert validation.two_point_law(_runs([30, 30, 20, 10, 5])) is None
    shown = [r | {"task": "t", "mean_gain": 1.0} for r in _runs([60, 35, 22.5, None, 13.125])]
    assert "not reached" in validation.table(validation.predictions(shown))
