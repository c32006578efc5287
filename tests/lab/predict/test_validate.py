"""Validation against a tiny synthetic scaling report, worked out by hand."""

import argparse
import contextlib
import io
import json
from dataclasses import replace

import predict_validation
import pytest
from predict_lab.validate import measured_steps, validate

from dpscale.cli import predict as cli
from dpscale.lab.predict.profile import explicit

MIB = 1 << 20


def _profile():
    # 1 MiB of gradients: one bucket, ready when backward ends; 50 ms forward + 50 ms backward
    p = explicit(
        params=MIB // 4, bytes_per_param=4, step_compute_ms=100, backward_fraction=0.5, per_worker_batch=8
    )
    # two workers on one host compute 1.5x slower: measured by the profile (--co-located 2), another run
    return replace(p, engine_overhead_ms={"dpscale": 10.0, "torch": 20.0}, contention={2: 1.5})


def _point(engine, transport, n, step_ms):
    return {
        "engine": engine,
        "transport": transport,
        "world_size": n,
        "per_worker_batch": 8,
        "step_ms": step_ms,
    }


def _scaling() -> dict:
    points = [
        _point("dpscale", "gloo", 1, 115.0),
        _point("local", "none", 1, 100.0),
        _point("dpscale", "shm", 2, 170.0),
        _point("torch", "gloo", 2, 200.0),
        _point("local", "none", 2, 150.0),
    ]
    runs = [
        {
            "engine": p["engine"],
            "world_size": p["world_size"],
            "step_ms": [[p["step_ms"] * f] for f in (0.9, 1, 1.1, 2)],
        }
        for p in points
    ]
    return {"config": {"model": "toy", "per_worker_batch": 8}, "points": points, "runs": runs}


def _allreduce() -> dict:
    sizes = (4, 4096, MIB, 4 * MIB)
    curves = {
        ("gloo", 1): lambda b: 10.0,
        ("gloo", 2): lambda b: 200 + b / 500,
        ("shm", 2): lambda b: 100 + b / 1e3,
    }
    points = [
        {"transport": t, "world_size": n, "bytes": b, "time_us": f(b)}
        for (t, n), f in curves.items()
        for b in sizes
    ]
    fits = [
        {"transport": "gloo", "world_size": 2, "alpha_us": 200.0, "beta_GBps": 0.5},
        {"transport": "shm", "world_size": 2, "alpha_us": 100.0, "beta_GBps": 1.0},
    ]
    return {"config": {}, "points": points, "fits": fits}


def test_predictions_by_hand():
    result = validate(_scaling(), _profile(), allreduce=_allreduce())
    rows = {(r.engine, r.world_size): r for r in result.rows}
    # N = 1: compute 100 + dpscale's 10 ms; a gloo call at world size 1 costs 10 us
    assert rows["dpscale", 1].predicted_step_ms == pytest.approx(110.0 + 0.010)
    # N = 2: compute x 1.5 (the profile's contention); shm reduces inline, 1 MiB: 100 us + 1 MiB / 1 GB/s
    assert rows["dpscale", 2].compute_factor == pytest.approx(1.5)
    assert rows["dpscale", 2].predicted_step_ms == pytest.approx(165.0 + (100 + MIB / 1e3) / 1e3)
    # gloo overlaps, but the only bucket is ready when backward ends: all of it is exposed
    assert rows["torch", 2].predicted_exposed_ms == pytest.approx((200 + MIB / 500) / 1e3)
    assert rows["torch", 2].predicted_step_ms == pytest.approx(180.0 + (200 + MIB / 500) / 1e3)
    err = 100 * (rows["torch", 2].predicted_step_ms - 200) / 200
    assert rows["torch", 2].error_pct == pytest.approx(err)
    assert rows["torch", 2].within_target is True
    # the local engine is predicted too (the profile's compute x its contention): a check, not an input
    assert rows["local", 2].predicted_step_ms == pytest.approx(150.0)
    assert rows["local", 2].role == "check" and rows["local", 2].within_target is True
    assert len(result.checks) == 5


def test_percentiles_use_the_raw_runs():
    steps = measured_steps(_scaling(), "p25")
    assert steps["local", 1] == pytest.approx(97.5)  # [90, 100, 110, 200]: a quarter of the way 90 -> 100
    result = validate(_scaling(), _profile(), allreduce=_allreduce(), statistic="p25")
    assert result.statistic == "p25"
    for bad in ("mean", "p200"):
        with pytest.raises(ValueError, match="--statistic"):
            measured_steps(_scaling(), bad)
    with pytest.raises(ValueError, match="--statistic"):
        measured_steps({"points": []}, "p25")


def test_paired_statistic_cancels_a_burst_that_hits_both_engines_in_a_round():
    # rounds of 5 steps; in round 2 a burst doubles every step of both engines
    local = [100.0] * 5 + [200.0] * 5 + [100.0] * 5
    engine = [110.0] * 5 + [220.0] * 5 + [110.0] * 5
    runs = [
        {"engine": "local", "world_size": 2, "step_ms": [[t, t] for t in local]},
        {"engine": "torch", "world_size": 2, "step_ms": [[t, t - 1] for t in engine]},
    ]
    steps = measured_steps({"points": [], "runs": runs}, "paired")
    assert steps["local", 2] == 100.0
    assert steps["torch", 2] == pytest.approx(110.0)  # median of round deltas (10, 20, 10) on top of local


def test_nothing_of_the_checked_report_goes_into_its_prediction():
    # the report's local engine ran 3x slower (a loaded machine): the predictions do not move with it,
    # they miss; before, the level came from this very row (--compute-from local)
    slow = _scaling()
    for point in slow["points"]:
        if point["engine"] == "local":
            point["step_ms"] *= 3
    before = validate(_scaling(), _profile(), allreduce=_allreduce())
    after = validate(slow, _profile(), allreduce=_allreduce())
    for a, b in zip(before.rows, after.rows, strict=True):
        assert a.predicted_step_ms == b.predicted_step_ms
    local = {r.world_size: r for r in after.rows if r.engine == "local"}
    assert local[2].within_target is False and local[2].error_pct == pytest.approx(-66.7, abs=0.1)


def test_without_calibration_the_presets_are_used():
    result = validate(_scaling(), _profile())
    assert all(r.predicted_step_ms > 0 for r in result.rows)


@pytest.mark.slow
def test_benchmark_validate_reads_report_directories(tmp_path):
    for name, results in (("scaling", _scaling()), ("allreduce", _allreduce())):
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps({"results": results}))
    profile = _profile().save(tmp_path / "profile.json")
    argv = ["--report-dir", str(tmp_path / "reports"), "validate", str(tmp_path / "scaling")]
    argv += ["--calibrate", str(tmp_path / "allreduce"), "--profile", str(profile)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert predict_validation.main(argv) == 0
    text = out.getvalue()
    assert "checks: 5/5 within 15%" in text
    (report,) = (tmp_path / "reports").iterdir()
    rows = json.loads((report / "report.json").read_text())["results"]["rows"]
    assert {(r["engine"], r["world_size"]) for r in rows} == {
        ("dpscale", 1),
        ("local", 1),
        ("dpscale", 2),
        ("torch", 2),
        ("local", 2),
    }
    assert {p.name for p in report.iterdir()} == {
        "report.json",
        "report.md",
        "validation.csv",
        "validation.png",
    }
    with pytest.raises(ValueError, match="scaling_report"):
        predict_validation.main(["validate", str(tmp_path / "nothing"), "--profile", str(profile)])


def test_predict_has_no_validate_flag_any_more():
    parser = argparse.ArgumentParser()
    cli.add_predict_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--validate", "somewhere"])


def test_local_validation_reports_how_far_the_load_moved_the_bare_step():
    before = replace(_profile(), contention={})
    after = replace(before, forward_ms=before.forward_ms * 1.5)  # 50 + 50 ms -> 75 + 50 ms
    line = predict_validation.load_drift(before, after, 2.5)
    assert "100.00 ms before the bench, 125.00 ms after (+25.0%)" in line
    assert "load average 2.5 before" in line and "co-located" not in line
    # the lockstep slowdown of two workers, when both profiles measured it
    line = predict_validation.load_drift(
        replace(before, contention={2: 2.2}), replace(after, contention={2: 3.3}), 9
    )
    assert "2 co-located workers 2.20x slower before, 3.30x after" in line


def test_local_validation_times_dpscale_on_shm_alone(monkeypatch, tmp_path):
    # shm between the gloo engines' 5-step rounds steps 2-5x faster on a loaded machine than a job
    # running it alone does (docs/performance-model.md): its rows come from a run of their own
    config = predict_validation.scaling.ScalingConfig(
        model="digits", per_worker_batch=8, world_sizes=[1, 2], engines=["dpscale", "torch", "local"]
    )
    doc = {
        "points": [
            _point("dpscale", "gloo", 1, 101.0),
            _point("dpscale", "shm", 2, 102.0),
            _point("torch", "gloo", 2, 103.0),
        ],
        "runs": [{"engine": "dpscale", "world_size": 2, "step_ms": [[1.0, 2.0]]}],
    }
    ran = []

    class Alone:
        def to_dict(self):
            return {
                "points": [_point("dpscale", "shm", 2, 555.0)],
                "runs": [{"engine": "dpscale", "world_size": 2, "step_ms": [[5.0, 6.0]]}],
            }

    monkeypatch.setattr(predict_validation.scaling, "run", lambda c: ran.append(c) or Alone())
    monkeypatch.setattr(predict_validation.scaling_report, "write_report", lambda *a: None)
    # a real report directory runs `git` for its system info: the fast tier starts no process
    monkeypatch.setattr(predict_validation.ReportDir, "create", lambda *a, **k: None)
    with contextlib.redirect_stdout(io.StringIO()):
        out = predict_validation.with_shm_alone(doc, config, str(tmp_path))
    assert [(c.engines, c.world_sizes) for c in ran] == [(["dpscale"], [2])]
    steps = {(p["engine"], p["world_size"]): p["step_ms"] for p in out["points"]}
    assert steps == {("dpscale", 1): 101.0, ("dpscale", 2): 555.0, ("torch", 2): 103.0}
    assert out["runs"] == [{"engine": "dpscale", "world_size": 2, "step_ms": [[5.0, 6.0]]}]
    # nothing on shm (no x86-64): no extra run
    ran.clear()
    gloo_only = {**doc, "points": [p for p in doc["points"] if p["transport"] != "shm"]}
    assert predict_validation.with_shm_alone(gloo_only, config, str(tmp_path)) is gloo_only and not ran
