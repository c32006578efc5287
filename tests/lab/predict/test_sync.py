"""In-step sync overheads (predict/sync.py): the figures from raw rounds, their use in the model, the
profile's JSON, and one real calibration on two ranks."""

from dataclasses import replace

import pytest

from dpscale.lab.predict import sync
from dpscale.lab.predict.cluster import INTER, INTRA, Cluster, Link
from dpscale.lab.predict.model import IN_STEP_LABEL, PredictConfig, predict
from dpscale.lab.predict.profile import ModelProfile, explicit
from dpscale.lab.predict.sync import SyncCost

MB = 1024 * 1024


def _round(compute_ms: float, comm_ms: float, steps: int = 5) -> list[tuple[float, float]]:
    return [(compute_ms, comm_ms)] * steps


def test_summarize_charges_what_a_synchronized_step_adds_per_call():
    # free compute 1 ms; tight 2 buckets in 0.4 ms; in-step: compute 1.3 ms then 1.1 ms of calls
    # -> (2.4 - 1.0 - 0.4) / 2 = 0.5 ms per call; rank 1 is the slower one and counts
    rank0 = {"free": [_round(1.0, 0.0)] * 3, "tight:gloo": [_round(0.0, 0.3)] * 3}
    rank0["in-step:gloo"] = [_round(1.2, 1.0)] * 3
    rank1 = {"free": [_round(0.9, 0.0)] * 3, "tight:gloo": [_round(0.0, 0.4)] * 3}
    rank1["in-step:gloo"] = [_round(1.3, 1.1)] * 3
    (cost,) = sync.summarize([rank0, rank1], ["gloo"], [4096, 8192])
    assert cost.world_size == 2 and cost.buckets == 2
    assert cost.free_compute_ms == pytest.approx(1.0)
    assert cost.tight_comm_ms == pytest.approx(0.4)
    assert cost.in_step_ms == pytest.approx(2.4)
    assert cost.call_overhead_ms == pytest.approx(0.5)
    assert cost.step_comm_ms == pytest.approx(0.4 + 2 * 0.5)


def test_summarize_never_reports_a_negative_overhead():
    ranks = [{"free": [_round(1.0, 0)], "tight:shm": [_round(0, 0.1)], "in-step:shm": [_round(0.9, 0.1)]}]
    (cost,) = sync.summarize(ranks, ["shm"], [64])
    assert cost.call_overhead_ms == 0.0


def _cost(transport: str, n: int, call_ms: float, tight_ms: float, bucket_bytes=(MB,)) -> SyncCost:
    return SyncCost(
        transport=transport,
        world_size=n,
        call_overhead_ms=call_ms,
        free_compute_ms=1.0,
        in_step_ms=0.0,
        tight_comm_ms=tight_ms,
        bucket_bytes=tuple(bucket_bytes),
    )


def _cluster() -> Cluster:
    # 1 MiB over a 1 GB/s ring at n = 2: 1.048576 ms, no latency or overhead
    link = Link(name=INTRA, bandwidth_GBps=1.0, latency_us=0.0)
    return Cluster(workers_per_node=2, intra=link, inter=replace(link, name=INTER))


def _profile(*sync_costs: SyncCost) -> ModelProfile:
    p = explicit(
        params=MB // 4, bytes_per_param=4, step_compute_ms=10, backward_fraction=0.5, per_worker_batch=8
    )
    return replace(p, engine_overhead_ms={"dpscale": 0.5}, sync=sync_costs)


def test_model_adds_the_call_overhead_and_takes_the_calibrated_level():
    one, two = _cost("gloo", 1, 0.2, 0.1), _cost("gloo", 2, 0.7, 2 * 1.048576)
    config = PredictConfig(world_sizes=[2], overlap=False, algorithm="ring", sync_transport="gloo")
    (p,) = predict(_profile(one, two), _cluster(), config)
    (plain,) = predict(_profile(one, two), _cluster(), replace(config, sync_transport=None))
    # the bench's 1.05 ms doubled to the calibration's level, + 0.7 ms per call
    assert p.comm_ms == pytest.approx(2 * 1.048576 + 0.7)
    assert p.terms_ms[IN_STEP_LABEL] == pytest.approx(0.7)
    # the engine overhead loses the one-worker gloo calls it was measured with (0.1 + 0.2 ms)
    assert p.compute_ms == pytest.approx(10 + 0.5 - 0.3)
    assert plain.comm_ms == pytest.approx(1.048576) and plain.compute_ms == pytest.approx(10.5)
    assert p.step_ms == pytest.approx(p.compute_ms + p.comm_ms)


def test_one_worker_on_gloo_is_what_the_profile_measured():
    one = _cost("gloo", 1, 0.2, 0.0)  # the cluster has no one-worker time to put at a level
    config = PredictConfig(world_sizes=[1], overlap=False, sync_transport="gloo")
    (p,) = predict(_profile(one), _cluster(), config)
    # the swap of the one-worker calls cancels out: compute + overhead as profiled
    assert p.step_ms == pytest.approx(10.5)


def test_dpscale_on_shm_starts_from_the_overhead_profiled_on_shm():
    """dpscale's engine costs less on a one-worker shm transport than on gloo (no thread hand-offs):
    a shm prediction starts from that figure and takes out shm's one-worker calls, not gloo's."""
    costs = (_cost("gloo", 1, 0.2, 0.1), _cost("shm", 1, 0.01, 0.02), _cost("shm", 2, 0.05, 2 * 1.048576))
    prof = replace(_profile(*costs), engine_overhead_ms={"dpscale": 0.5, "dpscale@shm": 0.2})
    config = PredictConfig(world_sizes=[2], overlap=False, algorithm="ring", sync_transport="shm")
    (p,) = predict(prof, _cluster(), config)
    assert p.compute_ms == pytest.approx(10 + 0.2 - 0.03)
    (g,) = predict(prof, _cluster(), replace(config, sync_transport="gloo"))
    assert g.compute_ms == pytest.approx(10 + 0.5)  # no gloo calibration at 2: as profiled on gloo


def test_a_transport_or_world_size_without_calibration_predicts_as_before():
    config = PredictConfig(world_sizes=[2], overlap=False, algorithm="ring", sync_transport="shm")
    (p,) = predict(_profile(_cost("gloo", 2, 0.7, 1.0)), _cluster(), config)
    assert p.comm_ms == pytest.approx(1.048576) and IN_STEP_LABEL not in p.terms_ms


def test_profile_json_round_trip_keeps_the_sync_costs(tmp_path):
    prof = _profile(_cost("gloo", 1, 0.2, 0.1), _cost("shm", 2, 0.05, 0.03, (4096, MB)))
    loaded = ModelProfile.load(prof.save(tmp_path / "p.json"))
    assert loaded.sync == prof.sync
    assert loaded.sync_cost("shm", 2).bucket_bytes == (4096, MB)
    assert loaded.sync_cost("shm", 1) is None


@pytest.mark.slow
def test_measure_on_two_ranks():
    # the real thing, small: digits (sub-ms steps), both local transports, few rounds
    costs = sync.measure("digits", 16, [26_122 * 4], 2, rounds=2)
    assert [(c.transport, c.world_size) for c in costs] == [("gloo", 2), ("shm", 2)]
    for c in costs:
        assert c.free_compute_ms > 0 and c.tight_comm_ms > 0 and c.call_overhead_ms >= 0
        assert c.bucket_bytes == (26_122 * 4,)


def test_bad_world_size_names_the_flag():
    with pytest.raises(ValueError, match="--co-located"):
        sync.measure("digits", 16, [64], 0)


def test_validate_applies_each_points_transport_and_dpscale_gloo_uses_dpscales_overhead():
    from predict_lab.validate import validate

    def point(engine, transport, n, step_ms):
        keys = ("engine", "transport", "world_size", "per_worker_batch", "step_ms")
        return dict(zip(keys, (engine, transport, n, 8, step_ms), strict=True))

    points = [point("local", "none", 2, 10.0), point("dpscale-gloo", "gloo", 2, 13.0)]
    scaling = {"config": {"model": "toy"}, "points": points}
    prof = _profile(_cost("gloo", 2, 1.5, 0.0))  # tight not measured: level 1, the presets stand
    with_sync = validate(scaling, prof).rows[1]
    without = validate(scaling, replace(prof, sync=())).rows[1]
    assert with_sync.predicted_comm_ms == pytest.approx(without.predicted_comm_ms + 1.5)
    # dpscale's 0.5 ms one-worker overhead, not "none"
    assert without.predicted_step_ms == pytest.approx(10.0 + 0.5 + without.predicted_exposed_ms)
