"""`dpscale predict --from-scale`: compute and the local link calibrated from a measured run's report."""

import json

import pytest

from dpscale.lab.predict import profile as profiles
from dpscale.lab.predict.cluster import preset_cluster
from dpscale.lab.predict.degrade import ScaleTerms
from dpscale.lab.predict.from_scale import (
    calibrated_compute,
    calibrated_fabric,
    read_scale_report,
    report_profile,
)
from dpscale.lab.predict.model import PredictConfig, predict

PROFILE = profiles.explicit(
    params=20_000_000, bytes_per_param=4, step_compute_ms=80.0, backward_fraction=2 / 3, per_worker_batch=32
)


def _report(tmp_path, points, profile=PROFILE) -> str:
    results = {"config": {}, "points": points, "profile": profile.to_dict() if profile else None}
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"command": "scale", "results": results}))
    return str(path)


def _points(steps: dict[int, float], engine: str = "dpscale") -> list[dict]:
    return [{"engine": engine, "world_size": n, "step_ms": ms, "hosts": 1} for n, ms in steps.items()]


def test_the_calibrated_prediction_reproduces_the_measured_steps(tmp_path):
    # a made-up run: 100 ms alone, 160 ms at N = 2 on one host (its reductions mostly exposed)
    run = read_scale_report(_report(tmp_path, _points({1: 100.0, 2: 160.0})))
    prof = calibrated_compute(report_profile(run), run)
    assert prof.compute_ms == pytest.approx(100.0)
    config = PredictConfig(world_sizes=[1, 2, 4, 8], engine="none", terms=ScaleTerms(stragglers=False))
    cluster = calibrated_fabric(prof, preset_cluster("cpu-shm"), config, run)
    assert "fitted to the measured steps" in cluster.source and cluster.intra.efficiency == 1.0
    rows = predict(prof, cluster, config)
    assert rows[0].step_ms == pytest.approx(100.0, rel=0.01)
    assert rows[1].step_ms == pytest.approx(160.0, rel=0.02)
    assert [r.world_size for r in rows] == [1, 2, 4, 8]


def test_a_run_that_hid_its_reductions_keeps_the_preset_link(tmp_path):
    run = read_scale_report(_report(tmp_path, _points({1: 100.0, 2: 99.0})))
    prof = calibrated_compute(report_profile(run), run)
    base = preset_cluster("cpu-shm")
    cluster = calibrated_fabric(prof, base, PredictConfig(world_sizes=[1, 2]), run)
    assert cluster.intra == base.intra and "hid its reductions" in cluster.source


@pytest.mark.parametrize(
    "points, says",
    [
        ([{"engine": "dpscale", "world_size": 1}], "points[0] lacks step_ms"),
        (_points({1: 100.0, 2: -1.0}), "points[1].step_ms: expected a number > 0"),
        (_points({2: 100.0, 4: 120.0}), "no N = 1 step"),
        (_points({1: 100.0}), "at N = 1 only"),
        ([], "no points"),
    ],
)
def test_a_bad_report_is_one_line_naming_it(tmp_path, points, says):
    with pytest.raises(ValueError, match="--from-scale") as e:
        read_scale_report(_report(tmp_path, points))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_report_without_a_profile_needs_one_and_a_file_that_is_not_json_is_refused(tmp_path):
    run = read_scale_report(_report(tmp_path, _points({1: 100.0, 2: 120.0}), profile=None))
    with pytest.raises(ValueError, match="--profile FILE or --params"):
        report_profile(run)
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="--from-scale"):
        read_scale_report(str(bad))
