"""A cluster calibrated from measured all-reduce times: fitted on one table, checked on another."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from dpscale.lab.predict.cluster import preset_cluster
from dpscale.lab.predict.costs import all_reduce_cost
from dpscale.lab.predict.fabric_fit import calibrated_from, from_table, read_measurements
from dpscale.lab.predict.nccl_tests import busbw_GBps, read_table

DATA = Path(__file__).resolve().parent / "data" / "nccl_tests"
H100_16 = DATA / "h100-16gpu-2node.txt"
PCIE_2 = DATA / "h100-pcie-2gpu-large.txt"
# nccl-tests issue #309: 2 x 8 H100 SXM, 8 x 400 Gb/s InfiniBand per host, on two clusters
XE9680 = DATA / "h100-ndr-16gpu-2node-xe9680.txt"
OTHER_CLUSTER = DATA / "h100-ndr-16gpu-2node-other-cluster.txt"
OTHER_CLUSTER_BY_GPUS = {
    16: OTHER_CLUSTER,
    32: DATA / "h100-ndr-32gpu-4node-other-cluster.txt",
    64: DATA / "h100-ndr-64gpu-8node-other-cluster.txt",
}


def test_fitted_on_the_out_of_place_runs_it_predicts_the_in_place_runs_within_10_percent_at_every_size():
    # the target: with an nccl-tests calibration of the same fabric, the predicted busbw at
    # the calibrated N is within 10% of the measured one at every size (the in-place column is a
    # second measurement of each size, not used by the fit)
    table = read_table(H100_16)
    cluster = calibrated_from(preset_cluster("dgx-h100"), [from_table(table)])
    for size, measured_us in zip(table.sizes_bytes, table.in_place_time_us, strict=True):
        predicted_us = all_reduce_cost(size, 16, cluster).seconds * 1e6
        predicted, measured = busbw_GBps(size, predicted_us, 16), busbw_GBps(size, measured_us, 16)
        assert predicted == pytest.approx(measured, rel=0.10), size


def test_fitted_on_one_cluster_it_predicts_another_of_the_same_hardware_within_10_percent_from_16_MiB():
    # the target checked on an independent run: two clusters of the same hardware, each direction,
    # at the sizes both runs measured (1 MiB - 8 GiB, 14 sizes)
    for fit, check in ((XE9680, OTHER_CLUSTER), (OTHER_CLUSTER, XE9680)):
        fitted, measured = read_table(fit), read_table(check)
        cluster = calibrated_from(preset_cluster("dgx-h100"), [from_table(fitted)])
        common = [s for s in measured.sizes_bytes if s in fitted.sizes_bytes]
        assert len(common) == 14
        for size in common:
            measured_us = measured.time_us[measured.sizes_bytes.index(size)]
            predicted_us = all_reduce_cost(size, 16, cluster).seconds * 1e6
            error = busbw_GBps(size, predicted_us, 16) / busbw_GBps(size, measured_us, 16) - 1
            if size >= 1 << 24:
                assert abs(error) <= 0.10, (fit.name, size, error)
            else:
                # 1-8 MiB: the clusters themselves differ by 14-30% (72 against 93 us at 1 MiB), and
                # at the calibrated N the prediction is the calibrating run's own time
                assert abs(error) > 0.10, (fit.name, size, error)
                fitted_us = fitted.time_us[fitted.sizes_bytes.index(size)]
                assert predicted_us == pytest.approx(fitted_us, rel=1e-6), size


def _busbw_errors(fit_gpus: int, check_gpus: int) -> dict[int, float]:
    """Predicted / measured busbw - 1 at each size of the other cluster's run at `check_gpus`."""
    cluster = calibrated_from(
        preset_cluster("dgx-h100"), [from_table(read_table(OTHER_CLUSTER_BY_GPUS[fit_gpus]))]
    )
    measured = read_table(OTHER_CLUSTER_BY_GPUS[check_gpus])
    out = {}
    for size, measured_us in zip(measured.sizes_bytes, measured.in_place_time_us, strict=True):
        predicted_us = all_reduce_cost(size, check_gpus, cluster).seconds * 1e6
        out[size] = busbw_GBps(size, predicted_us, check_gpus) / busbw_GBps(size, measured_us, check_gpus) - 1
    return out


def test_other_node_counts_of_one_cluster_from_its_calibration_are_not_within_10_percent():
    # not a target, a record (docs/performance-model.md): the same cluster's 2-, 4- and 8-node runs
    # (nccl-tests issue #309). 2 -> 4 nodes: within 10% from 256 MiB up, 16-51% low below (in-place)
    two_to_four = _busbw_errors(16, 32)
    assert all(abs(e) <= 0.10 for s, e in two_to_four.items() if s >= 1 << 28)
    assert min(two_to_four.values()) < -0.30
    # 4 -> 8 nodes: the measured busbw is level at the largest sizes (325 -> 321 GB/s) where the NVLS
    # path's ring over nodes gives 2(k-1)/k of the data to each node's links: 12-14% low at 2-8 GiB
    four_to_eight = _busbw_errors(32, 64)
    assert all(-0.15 < four_to_eight[s] < -0.10 for s in (1 << 31, 1 << 32, 1 << 33))


def test_a_multi_node_table_sets_the_inter_node_link_and_the_gpus_per_node():
    cluster = calibrated_from(preset_cluster("dgx-h100"), read_measurements([str(H100_16)]))
    assert cluster.workers_per_node == 8 and cluster.inter.efficiency == 1.0
    assert "inter-node link(s) fitted" in cluster.source and str(H100_16) in cluster.source
    # the fitted link reproduces the largest size's time at 16 when the measurement is set aside
    model = replace(cluster, measured={})
    largest = all_reduce_cost(8589934592, 16, model).seconds * 1e6
    assert largest == pytest.approx(47535, rel=0.01)
    # and predicts other world sizes from it: more nodes, a little less busbw on a ring of nodes
    bus = [busbw_GBps(1 << 30, all_reduce_cost(1 << 30, n, cluster).seconds * 1e6, n) for n in (32, 128)]
    assert bus[0] > bus[1] > 0


def test_a_one_node_table_sets_the_intra_node_link():
    base = preset_cluster("pcie4-x16+eth-100g")
    cluster = calibrated_from(base, read_measurements([str(PCIE_2)]))
    assert cluster.inter == base.inter and cluster.intra.efficiency == 1.0
    model = replace(cluster, measured={})
    assert all_reduce_cost(2147483648, 2, model).seconds * 1e6 == pytest.approx(18535, rel=0.01)


def _one_node_table(path: Path, busbw: float) -> Path:
    """A made-up 8-GPU one-node run (not a published one): 20 us + size at `busbw`."""
    ranks = "".join(f"#  Rank {r} Group 0 Pid {r} on node-a device {r} [0x0] GPU\n" for r in range(8))
    times = {s: f"{20 + s / (busbw * 1e3 / 1.75):.1f}" for s in (1 << 20, 1 << 24, 1 << 28, 1 << 32)}
    rows = "".join(f"{s} {s // 4} float sum -1 {t} 0 0 0 {t} 0 0 0\n" for s, t in times.items())
    path.write_text(ranks + rows)
    return path


def test_files_of_two_node_counts_calibrate_both_levels(tmp_path):
    one = _one_node_table(tmp_path / "one-node.txt", busbw=470.0)
    both = calibrated_from(preset_cluster("dgx-h100"), read_measurements([str(one), str(H100_16)]))
    assert set(both.measured) == {8, 16} and "intra-node and inter-node link(s) fitted" in both.source
    model = replace(both, measured={})
    for n, size, us in ((8, 1 << 32, 20 + (1 << 32) / (470e3 / 1.75)), (16, 8589934592, 47535)):
        assert all_reduce_cost(size, n, model).seconds * 1e6 == pytest.approx(us, rel=0.02)


def test_two_files_of_one_world_size_are_refused():
    with pytest.raises(ValueError, match="same world size"):
        read_measurements([str(H100_16), str(H100_16)])


def test_a_measurement_faster_than_the_other_level_allows_is_refused_naming_it():
    # 338 GB/s busbw across two nodes cannot pass through PCIe 4 inside them
    with pytest.raises(ValueError, match="no inter-node rate reproduces 16 workers") as e:
        calibrated_from(preset_cluster("pcie4-x16+eth-100g"), read_measurements([str(H100_16)]))
    assert "intra-node link" in str(e.value)


def test_a_bench_allreduce_report_calibrates_like_an_nccl_tests_file(tmp_path):
    pts = [
        {"transport": "gloo", "world_size": 2, "bytes": b, "time_us": 100 + b / 1e3}  # 100 us + 1 GB/s
        for b in (4, 4096, 1 << 20)
    ]
    fits = [{"transport": "gloo", "world_size": 2, "alpha_us": 100.0, "beta_GBps": 1.0, "points": 3}]
    (tmp_path / "report.json").write_text(
        json.dumps({"results": {"config": {}, "points": pts, "fits": fits}})
    )
    (m,) = read_measurements([str(tmp_path)])
    assert (m.nodes, m.times.world_size, m.times.transport) == (1, 2, "gloo")
    cluster = calibrated_from(preset_cluster("cpu-shm"), [m])
    model = replace(cluster, measured={})
    assert all_reduce_cost(1 << 20, 2, model).seconds * 1e6 == pytest.approx(100 + (1 << 20) / 1e3, rel=0.02)
    with pytest.raises(ValueError, match="--calibrate-from"):
        read_measurements([str(tmp_path / "absent")])


def test_other_world_sizes_take_the_measured_shortfall_by_size():
    # the fitted link with the measured shortfall at each size (Cluster.size_factors) reproduces the
    # calibrated N without its measured times, so other N get the same size dependence: mid-size
    # messages measured several times slower than a two-parameter link would give
    table = read_table(H100_16)
    cluster = calibrated_from(preset_cluster("dgx-h100"), [from_table(table)])
    model = replace(cluster, measured={})
    for size, measured_us in zip(table.sizes_bytes, table.in_place_time_us, strict=True):
        assert all_reduce_cost(size, 16, model).seconds * 1e6 == pytest.approx(measured_us, rel=0.10), size
    bare = replace(model, size_factors={})
    at_32 = [all_reduce_cost(1 << 24, 32, c).seconds for c in (model, bare)]
    assert at_32[0] > 2 * at_32[1]  # 16 MiB: 977.6 us measured at 16, where the fitted link alone gives ~220
