"""`dpscale predict --goodput`: the McCandlish batch-size model, its inputs, and the ranking."""

import argparse
import contextlib
import io
import itertools
import json
import sys

import pytest

from dpscale.cli import predict as cli
from dpscale.lab.predict import goodput

EXPLICIT = ["--params", "25.6e6", "--step-compute-ms", "120", "--per-worker-batch", "32"]


def test_steps_and_samples_follow_the_paper_and_pass_through_the_measured_run():
    noise, s_min = 400.0, 1000.0
    for b in (10, 400, 4000):
        s = goodput.steps_to_target(b, s_min=s_min, noise_scale=noise)
        assert s * b == pytest.approx(goodput.samples_to_target(b, s_min=s_min, noise_scale=noise))
    # at B = B_noise: twice the minimal steps and twice the minimal samples
    assert goodput.steps_to_target(400, s_min=s_min, noise_scale=noise) == 2 * s_min
    assert goodput.samples_to_target(400, s_min=s_min, noise_scale=noise) == 2 * s_min * noise
    fitted = goodput.s_min_from_run(3000, 200, noise)  # a run: 3000 steps at batch 200
    assert goodput.steps_to_target(200, s_min=fitted, noise_scale=noise) == pytest.approx(3000)
    with pytest.raises(ValueError, match="target-steps"):
        goodput.s_min_from_run(0, 200, noise)


def test_soonest_and_cheapest_are_the_brute_force_minima():
    # step time grows with the per-worker batch and with the workers (communication)
    step_ms = {
        (n, b): 5 + 0.1 * b + 2 * n**0.5 for n, b in itertools.product((1, 2, 4, 8, 16, 64), (8, 32, 128))
    }
    points = goodput.goodput_points(step_ms, s_min=500, noise_scale=300)
    by_time = min(points, key=lambda p: p.steps * p.step_ms)
    by_cost = min(points, key=lambda p: p.world_size * p.steps * p.step_ms)
    assert goodput.fastest(points) == by_time and goodput.cheapest(points) == by_cost
    # workers cost communication, so the least worker-time is on one worker; and the soonest is not
    # on the most workers: past the noise scale (300) a bigger global batch saves few steps
    assert by_cost.world_size == 1 and by_time.world_size == 16 and by_time.global_batch > 300
    table = goodput.format_table(points)
    assert "<- soonest" in table and "<- least worker-time" in table


def test_noise_scale_from_a_number_a_train_summary_and_metrics(tmp_path):
    assert goodput.load_noise_scale("512").noise_scale == 512
    summary = tmp_path / "run.json"
    summary.write_text(
        "some log line\n" + json.dumps({"gradient_noise_scale": 321.5, "steps": 90, "global_batch": 64})
    )
    src = goodput.load_noise_scale(str(summary))
    assert (src.noise_scale, src.steps, src.global_batch) == (321.5, 90, 64)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "gns": g}) for s, g in ((1, None), (2, 100.0), (3, 120.0)))
    )
    assert goodput.load_noise_scale(str(tmp_path / "m")).noise_scale == 120.0
    for bad, match in (("-3", "positive"), (str(tmp_path / "missing.json"), "neither a number nor a file")):
        with pytest.raises(ValueError, match=match):
            goodput.load_noise_scale(bad)
    none = tmp_path / "none.json"
    none.write_text(json.dumps({"gradient_noise_scale": None, "steps": 5, "global_batch": 8}))
    with pytest.raises(ValueError, match="no positive noise scale"):
        goodput.load_noise_scale(str(none))


def _predict(argv, monkeypatch):
    parser = argparse.ArgumentParser()
    cli.add_predict_arguments(parser)
    args = parser.parse_args(argv)
    out = io.StringIO()
    monkeypatch.setattr(sys, "argv", ["dpscale", "predict", *argv])
    with contextlib.redirect_stdout(out):
        rc = cli.run_predict_from_args(args)
    return rc, out.getvalue()


def test_cli_ranks_workers_and_batches(tmp_path, monkeypatch):
    argv = [*EXPLICIT, "--preset", "dgx-a100", "--world-sizes", "1,8,64", "--goodput"]
    argv += ["--noise-scale", "2000", "--target-steps", "5000", "--target-batch", "256"]
    argv += ["--per-worker-batches", "16,64", "--json", "--report-dir", str(tmp_path)]
    rc, out = _predict(argv, monkeypatch)
    assert rc == 0
    rows = json.loads(out.strip().splitlines()[-1])
    assert {(r["world_size"], r["per_worker_batch"]) for r in rows} == set(
        itertools.product((1, 8, 64), (16, 64))
    )
    at_256 = [r for r in rows if r["global_batch"] == 1024 and r["world_size"] == 64]
    assert at_256[0]["steps"] == pytest.approx(5000 / (1 + 2000 / 256) * (1 + 2000 / 1024))
    assert "soonest: N=" in out and "least worker-time: N=" in out


def test_cli_goodput_needs_a_noise_scale_and_a_target(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="--noise-scale"):
        _predict([*EXPLICIT, "--goodput"], monkeypatch)
    with pytest.raises(ValueError, match="--target-steps"):
        _predict([*EXPLICIT, "--goodput", "--noise-scale", "100"], monkeypatch)
