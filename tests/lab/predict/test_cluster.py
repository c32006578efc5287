"""Presets, layouts and calibration from an all-reduce report."""

import json

import pytest

from dpscale.lab.predict.cluster import (
    CLUSTER_PRESETS,
    LINK_PRESETS,
    calibrated,
    load_allreduce_report,
    preset_cluster,
)


def test_every_link_preset_builds_and_cites_a_source():
    for name, preset in LINK_PRESETS.items():
        assert preset.source and preset.bandwidth_GBps > 0
        if name in CLUSTER_PRESETS:  # the CPU presets name whole clusters too
            continue
        c = preset_cluster(name)
        assert c.intra.bandwidth_GBps == c.inter.bandwidth_GBps == preset.bandwidth_GBps
        assert c.workers_per_node == 1  # one link name alone: one worker per host
    for name in CLUSTER_PRESETS:
        assert preset_cluster(name).source


def test_nominal_figures_from_the_spec_sheets():
    assert LINK_PRESETS["pcie4-x16"].bandwidth_GBps == pytest.approx(
        2 * LINK_PRESETS["pcie3-x16"].bandwidth_GBps
    )
    assert LINK_PRESETS["nvlink4"].bandwidth_GBps == 450  # 900 GB/s total, per direction half
    assert LINK_PRESETS["ib-ndr400"].bandwidth_GBps == 400 / 8
    assert LINK_PRESETS["eth-25g"].bandwidth_GBps == 25 / 8


def test_composed_and_multiplied_presets():
    c = preset_cluster("dgx-a100")
    assert c.workers_per_node == 8
    assert c.inter.bandwidth_GBps == pytest.approx(8 * 25)  # 8 x HDR 200
    c = preset_cluster("pcie3-x16+4xeth-100g")
    assert c.intra.bandwidth_GBps == pytest.approx(15.75)
    assert c.inter.bandwidth_GBps == pytest.approx(50)
    with pytest.raises(ValueError, match="--preset"):
        preset_cluster("nvlink9")


def test_layout_fills_nodes():
    c = preset_cluster("dgx-h100")
    assert (c.layout(4).nodes, c.layout(4).per_node) == (1, 4)
    assert (c.layout(64).nodes, c.layout(64).per_node) == (8, 8)
    with pytest.raises(ValueError, match="--world-sizes"):
        c.layout(12)


def _allreduce_results() -> dict:
    pts = [{"transport": "gloo", "world_size": 1, "bytes": b, "time_us": 10.0} for b in (4, 4096, 1 << 20)]
    pts += [
        {"transport": "gloo", "world_size": 2, "bytes": b, "time_us": 100 + b / 1e3}  # alpha 100 us, 1 GB/s
        for b in (4, 4096, 1 << 20)
    ]
    fits = [{"transport": "gloo", "world_size": 2, "alpha_us": 100.0, "beta_GBps": 1.0, "points": 3}]
    return {"config": {}, "points": pts, "fits": fits}


def test_calibration_fits_the_intra_link_as_a_ring_and_keeps_measurements(tmp_path):
    (tmp_path / "report.json").write_text(json.dumps({"results": _allreduce_results()}))
    c = calibrated(preset_cluster("cpu-shm"), load_allreduce_report(tmp_path), "gloo")
    # n = 2: busbw = algbw * 2(n-1)/n = 1 GB/s; per-step latency = (alpha - per-call overhead) / 2(n-1)
    assert c.intra.bandwidth_GBps == pytest.approx(1.0)
    assert c.per_message_overhead_us == pytest.approx(10.0)  # a call at world size 1
    assert c.intra.latency_us == pytest.approx((100 - 10) / 2)
    assert sorted(c.measured) == [1, 2]
    with pytest.raises(ValueError, match="--calibrate"):
        calibrated(preset_cluster("cpu-shm"), _allreduce_results(), "nccl")


def test_a_missing_or_foreign_report_names_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--calibrate"):
        load_allreduce_report(tmp_path / "nothing")
    (tmp_path / "report.json").write_text(json.dumps({"results": {"points": []}}))
    with pytest.raises(ValueError, match="--calibrate"):
        load_allreduce_report(tmp_path)
