"""The at-scale terms (degrade.py) by hand: expected maximum, stragglers, congestion, interference, losses."""

import math
from dataclasses import replace

import pytest

from dpscale.lab.predict.cluster import INTER, INTRA, Cluster, Link
from dpscale.lab.predict.degrade import (
    INPUT_PIPELINE,
    INTERFERENCE,
    STRAGGLERS,
    ScaleTerms,
    cv_from_tail,
    expected_max_normal,
)
from dpscale.lab.predict.model import PredictConfig, predict
from dpscale.lab.predict.profile import explicit, robust_cv, step_to_step_cv

MB = 1 << 20


# E[max of n standard normals], tabulated (Harter 1961, Expected values of normal order statistics)
HARTER = {2: 0.56419, 3: 0.84628, 5: 1.16296, 10: 1.53875, 100: 2.50759}


@pytest.mark.parametrize("n", sorted(HARTER))
def test_expected_maximum_matches_the_tables(n):
    assert expected_max_normal(n) == pytest.approx(HARTER[n], abs=2e-4)


def test_expected_maximum_matches_a_simulation_at_1024():
    import random

    rng = random.Random(0)
    draws = [max(rng.gauss(0, 1) for _ in range(1024)) for _ in range(1000)]
    assert expected_max_normal(1024) == pytest.approx(sum(draws) / len(draws), abs=0.03)
    # the asymptotic sqrt(2 ln N) is far off at these sizes: the reason for integrating
    assert math.sqrt(2 * math.log(1024)) / expected_max_normal(1024) > 1.1


def test_expected_max_grows_like_sqrt_2_ln_n_and_is_0_for_one_worker():
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=0.02)  # exact: 0.5642
    for n in (128, 1024):
        assert 0.75 < expected_max_normal(n) / math.sqrt(2 * math.log(n)) < 1.0
    with pytest.raises(ValueError):
        expected_max_normal(0)


def test_tail_to_cv_and_robust_cv():
    assert cv_from_tail(1.0) == 0.0
    assert cv_from_tail(1 + 2.326) == pytest.approx(1.0, rel=1e-3)
    # a burst of 3 slow steps out of 20 does not pass for variation
    steps = [100.0, 101.0, 99.0, 100.5, 99.5] * 4
    steps[3:6] = [300.0, 300.0, 300.0]
    assert robust_cv(steps) < 0.02
    # a machine whose load doubles the step for a while: between rounds, not from step to step
    drift = [100.0, 102.0, 98.0, 101.0, 99.0] * 2 + [200.0, 204.0, 196.0, 202.0, 198.0] * 2
    assert robust_cv(drift) > 0.4 and step_to_step_cv(drift, per_round=5) == pytest.approx(0.0148, abs=1e-3)


def test_congestion_factor():
    t = ScaleTerms(oversubscription=2.0, nodes_per_switch=16)
    assert t.congestion_factor(1, 0.0) == 1.0
    assert t.congestion_factor(16, 0.0) == 1.0  # within one switch: non-blocking
    assert t.congestion_factor(32, 0.0) == 2.0
    # 10% lost per doubling: at 8 nodes 0.9^3 of the bandwidth is left
    assert ScaleTerms().congestion_factor(8, 0.1) == pytest.approx(1 / 0.9**3)
    assert ScaleTerms(congestion=False, oversubscription=3).congestion_factor(64, 0.1) == 1.0


def _cluster(**kw) -> Cluster:
    return Cluster(
        workers_per_node=8,
        intra=Link(name=INTRA, bandwidth_GBps=100.0, latency_us=0.0),
        inter=Link(name=INTER, bandwidth_GBps=1.0, latency_us=0.0),
        **kw,
    )


def _profile(step_ms=100.0):
    return explicit(
        params=25 * MB // 4,
        bytes_per_param=4,
        step_compute_ms=step_ms,
        backward_fraction=0.5,
        per_worker_batch=8,
    )


def test_stragglers_stretch_compute_by_cv_times_the_expected_maximum():
    config = PredictConfig(world_sizes=[1, 64], terms=ScaleTerms(compute_cv=0.05), algorithm="ring")
    one, many = predict(_profile(), _cluster(), config)
    assert one.compute_ms == pytest.approx(100.0)
    assert many.compute_ms == pytest.approx(100.0 * (1 + 0.05 * expected_max_normal(64)))
    assert many.losses_ms[STRAGGLERS] == pytest.approx(many.compute_ms - 100.0)
    off = PredictConfig(
        world_sizes=[64], terms=ScaleTerms(compute_cv=0.05, stragglers=False), algorithm="ring"
    )
    (plain,) = predict(_profile(), _cluster(), off)
    assert plain.compute_ms == pytest.approx(100.0) and STRAGGLERS not in plain.losses_ms


def test_node_noise_is_paid_over_the_nodes_and_not_inside_one():
    # 4 workers per node: 64 workers are 16 nodes; one node's 4 workers share its delay
    cluster = replace(_cluster(), workers_per_node=4)
    config = PredictConfig(
        world_sizes=[4, 64], terms=ScaleTerms(compute_cv=0.01, node_cv=0.03), algorithm="ring"
    )
    one_node, many = predict(_profile(), cluster, config)
    assert one_node.compute_ms == pytest.approx(100 * (1 + 0.01 * expected_max_normal(4)))
    assert many.compute_ms == pytest.approx(
        100 * (1 + 0.01 * expected_max_normal(64) + 0.03 * expected_max_normal(16))
    )
    # the cluster's node noise unless given; --no-stragglers removes both parts
    (p,) = predict(
        _profile(),
        replace(cluster, node_cv=0.03),
        replace(config, world_sizes=[64], terms=ScaleTerms(compute_cv=0.0)),
    )
    assert p.compute_ms == pytest.approx(100 * (1 + 0.03 * expected_max_normal(16)))
    (p,) = predict(
        _profile(),
        cluster,
        replace(config, world_sizes=[64], terms=ScaleTerms(stragglers=False, node_cv=0.03)),
    )
    assert p.compute_ms == pytest.approx(100.0)
    with pytest.raises(ValueError, match="--node-cv"):
        ScaleTerms(node_cv=1.5)


def test_the_profiles_cv_is_used_unless_given_and_the_clusters_last():
    prof = _profile()
    config = PredictConfig(world_sizes=[8], algorithm="ring")
    (p,) = predict(prof, _cluster(compute_cv=0.02), config)
    assert p.compute_ms == pytest.approx(100 * (1 + 0.02 * expected_max_normal(8)))
    (p,) = predict(replace(prof, compute_cv=0.01), _cluster(compute_cv=0.02), config)
    assert p.compute_ms == pytest.approx(100 * (1 + 0.01 * expected_max_normal(8)))


def test_interference_stretches_backward_by_the_hidden_communication():
    # one node, 25 buckets of 1 MiB spread evenly over 50 ms of backward; each takes 2 x 7/8 x 1 MiB
    # over 100 GB/s = 18 us, all hidden but the last
    config = PredictConfig(world_sizes=[8], algorithm="ring", bucket_mb=1)
    (plain,) = predict(_profile(), _cluster(), config)
    (slowed,) = predict(_profile(), _cluster(interference=0.5), config)
    hidden = plain.comm_ms - plain.exposed_comm_ms
    assert slowed.losses_ms[INTERFERENCE] == pytest.approx(0.5 * hidden)
    assert slowed.compute_ms == pytest.approx(plain.compute_ms + 0.5 * hidden)
    off = PredictConfig(
        world_sizes=[8], algorithm="ring", bucket_mb=1, terms=ScaleTerms(overlap_interference=False)
    )
    assert predict(_profile(), _cluster(interference=0.5), off)[0].compute_ms == pytest.approx(
        plain.compute_ms
    )


def test_losses_add_up_and_the_bottleneck_is_the_largest():
    terms = ScaleTerms(compute_cv=0.01, oversubscription=2.0)
    config = PredictConfig(world_sizes=[64], algorithm="ring", overlap=False, terms=terms)
    (p,) = predict(_profile(), _cluster(), config)
    assert sum(p.losses_ms.values()) == pytest.approx(p.step_ms - 100.0)
    assert p.losses_ms["inter-node congestion"] == pytest.approx(p.losses_ms["inter-node bandwidth"])
    assert p.bottleneck == max(p.losses_ms, key=p.losses_ms.__getitem__)


def test_the_input_pipeline_makes_the_step_wait_once_the_nodes_demand_exceeds_its_rate():
    # 8 workers of batch 8 per node, 100 ms steps: one worker asks 80 samples/s, a node 640
    config = PredictConfig(world_sizes=[1, 8, 64], algorithm="ring", terms=ScaleTerms(compute_cv=0.0))
    free = predict(_profile(), _cluster(), config)
    # a node that prepares 1000 samples/s feeds 8 workers: nothing changes
    assert [p.step_ms for p in predict(_profile(), _cluster(input_samples_per_s=1000.0), config)] == [
        pytest.approx(p.step_ms) for p in free
    ]
    # 320 samples/s: 8 workers' 64 samples take 200 ms to prepare, the step waits for them
    fed = predict(_profile(), _cluster(input_samples_per_s=320.0), config)
    one, node, many = fed
    assert one.step_ms == pytest.approx(100.0) and one.efficiency == pytest.approx(1.0)
    assert node.step_ms == pytest.approx(200.0) and node.efficiency == pytest.approx(0.5)
    assert node.losses_ms[INPUT_PIPELINE] == pytest.approx(200.0 - free[1].step_ms)
    assert node.bottleneck == INPUT_PIPELINE
    # every node has its own host: 64 workers on 8 nodes wait as long as one node's 8
    assert many.step_ms == pytest.approx(max(200.0, free[2].step_ms))
    # the flag overrides the cluster's rate; --no-input-pipeline switches it off
    (p,) = predict(_profile(), _cluster(), replace(config, world_sizes=[8], terms=ScaleTerms(
        compute_cv=0.0, input_samples_per_s=128.0)))  # fmt: skip
    assert p.step_ms == pytest.approx(500.0)
    off = ScaleTerms(compute_cv=0.0, input_pipeline=False, input_samples_per_s=128.0)
    (p,) = predict(
        _profile(), _cluster(input_samples_per_s=320.0), replace(config, world_sizes=[8], terms=off)
    )
    assert p.step_ms == pytest.approx(free[1].step_ms) and INPUT_PIPELINE not in p.losses_ms


def test_a_host_too_slow_for_one_worker_limits_the_baseline_too():
    # 40 samples/s cannot feed even one worker (80/s): the baseline is the pipeline's 200 ms per step
    config = PredictConfig(world_sizes=[1, 2], algorithm="ring", terms=ScaleTerms(compute_cv=0.0))
    one, two = predict(_profile(), _cluster(input_samples_per_s=40.0), config)
    assert one.step_ms == pytest.approx(200.0) and one.efficiency == pytest.approx(1.0)
    assert one.bottleneck == two.bottleneck == INPUT_PIPELINE  # one worker waits for data too
    assert two.step_ms == pytest.approx(400.0) and two.efficiency == pytest.approx(0.5)
    with pytest.raises(ValueError, match="--input-samples-per-s"):
        ScaleTerms(input_samples_per_s=0.0)


def test_the_profiles_input_rate_feeds_the_term_through_the_loaders_processes():
    # one process prepares 400 samples/s: a batch of 8 in 20 ms
    prof = replace(_profile(), input_samples_per_s=400.0)
    config = PredictConfig(world_sizes=[1, 8], algorithm="ring", terms=ScaleTerms(compute_cv=0.0))
    free = predict(prof, _cluster(), config)  # no --data-workers: the rate is recorded, not applied
    assert [p.step_ms for p in free] == [pytest.approx(100.0), pytest.approx(free[1].step_ms)]
    # 0: each worker loads its batch in its own loop before the step, at one and at eight workers
    one, node = predict(prof, _cluster(), replace(config, data_workers=0))
    assert one.step_ms == pytest.approx(120.0) and one.efficiency == pytest.approx(1.0)
    assert node.step_ms == pytest.approx(free[1].step_ms + 20.0)
    # 1 loader process per worker ahead of the step: 8 x 400 samples/s feed 8 x 8 per 100 ms
    assert [p.step_ms for p in predict(prof, _cluster(), replace(config, data_workers=1))] == [
        pytest.approx(p.step_ms) for p in free
    ]
    # a loader of 40 samples/s per process: 8 workers' 64 samples take 200 ms, at 2 processes each 100
    slow = replace(prof, input_samples_per_s=40.0)
    _, node = predict(slow, _cluster(), replace(config, data_workers=1))
    assert node.step_ms == pytest.approx(200.0) and node.bottleneck == INPUT_PIPELINE
    _, node = predict(slow, _cluster(), replace(config, data_workers=2))
    assert node.step_ms == pytest.approx(max(100.0, free[1].step_ms))
    # a measured node rate overrides the profile's; explicit numbers have no rate to use
    given = replace(config, data_workers=1, terms=ScaleTerms(compute_cv=0.0, input_samples_per_s=3200.0))
    assert predict(slow, _cluster(), given)[1].step_ms == pytest.approx(free[1].step_ms)
    with pytest.raises(ValueError, match="--data-workers"):
        predict(_profile(), _cluster(), replace(config, data_workers=1))
    with pytest.raises(ValueError, match="--data-workers"):
        PredictConfig(world_sizes=[1], data_workers=-1)
