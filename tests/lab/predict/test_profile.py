"""One-worker profiles: explicit numbers, bucket layout, batch scaling, JSON, and one real measurement."""

from dataclasses import replace

import pytest

from dpscale.comm.select import shm_is_safe
from dpscale.engine.buckets import MB
from dpscale.lab.predict import interfere, sync
from dpscale.lab.predict.profile import ModelProfile, ParamTiming, explicit
from dpscale.lab.predict.profiling import input_rate, measure, time_input


def test_explicit_profile_spreads_buckets_evenly_over_backward():
    p = explicit(
        params=10 * MB, bytes_per_param=4, step_compute_ms=90, backward_fraction=2 / 3, per_worker_batch=8
    )
    assert (p.forward_ms, p.backward_ms, p.optimizer_ms) == pytest.approx((30, 60, 0))
    buckets = p.buckets(bucket_mb=25, first_bucket_mb=1)
    assert [b.nbytes for b in buckets] == [1 * MB, 25 * MB, 14 * MB]  # 40 MiB: the engine's caps
    assert [b.ready_ms for b in buckets] == pytest.approx([60 * 1 / 40, 60 * 26 / 40, 60.0])


def test_measured_layout_follows_the_engine_assignment():
    # registration order a, b, c; backward produces c first: c fills the small first bucket alone
    params = (
        ParamTiming("a", MB // 2, 2 * MB, 9.0),
        ParamTiming("b", MB // 2, 2 * MB, 5.0),
        ParamTiming("c", MB // 4, MB, 1.0),
    )
    p = ModelProfile(
        model="toy",
        source="measured",
        per_worker_batch=4,
        forward_ms=3,
        backward_ms=10,
        optimizer_ms=1,
        param_count=MB + MB // 4,
        param_bytes=5 * MB,
        params=params,
    )
    assert [(b.nbytes, b.ready_ms) for b in p.buckets(25, 1)] == [(MB, 1.0), (4 * MB, 9.0)]
    assert [(b.nbytes, b.ready_ms) for b in p.buckets(2, 1)] == [(MB, 1.0), (2 * MB, 5.0), (2 * MB, 9.0)]
    doubled = p.at_batch(8)
    assert doubled.forward_ms == 6 and doubled.backward_ms == 20 and doubled.optimizer_ms == 1
    assert doubled.params[0].ready_ms == 18.0


def test_json_round_trip(tmp_path):
    p = explicit(params=1000, bytes_per_param=2, step_compute_ms=5, backward_fraction=0.5, per_worker_batch=4)
    p = replace(p, contention={2: 1.7}, input_samples_per_s=1234.5)  # int keys survive JSON's str keys
    path = p.save(tmp_path / "p.json")
    assert ModelProfile.load(path) == p
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="--profile"):
        ModelProfile.load(tmp_path / "bad.json")


def test_the_input_rate_is_the_median_batch_time_of_the_data_path():
    calls = []
    times = time_input(lambda: calls.append(1), min_s=0.0, min_calls=7)
    assert len(times) == len(calls) == 7 and min(times) >= 0
    # 16 samples per batch, batches of 2, 4 and 40 ms: the median (4 ms), not the mean
    assert input_rate(16, [2.0, 4.0, 40.0]) == pytest.approx(4000.0)
    assert input_rate(16, [0.0, 0.0, 1.0]) is None  # too fast to time: no rate rather than infinity


@pytest.mark.slow
def test_measure_a_small_workload(monkeypatch):
    # the fewest rounds the sync and interference measurements take (4 and 2, not ~20 s of each):
    # what they measure is tested in test_sync/test_interfere; here, that measure() wires them in.
    # (This test took 35 s on a quiet host, 345 s at load 12.)
    monkeypatch.setattr(sync, "BUDGET_S", 0.0)
    monkeypatch.setattr(interfere, "ROUNDS", 2)
    p = measure("digits", 16, steps=4, warmup=1, co_located=2)
    assert p.source == "measured" and p.threads == 1
    assert p.forward_ms > 0 and p.backward_ms > 0 and p.optimizer_ms > 0
    assert p.param_count == sum(t.numel for t in p.params) == 64 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10
    assert all(0 <= t.ready_ms for t in p.params)
    # the last layer's gradients are ready first
    assert p.params[-1].ready_ms <= p.params[0].ready_ms
    on_shm = {"dpscale@shm"} if shm_is_safe() else set()
    assert set(p.engine_overhead_ms) == {"dpscale", "torch"} | on_shm
    assert min(p.engine_overhead_ms.values()) >= 0
    assert p.system["hardware"]["logical_cores"] >= 1
    assert set(p.contention) == {2} and p.contention[2] > 0
    assert p.compute_cv is not None and p.compute_cv >= 0 and p.device == "cpu"
    assert p.interference is not None and 0 <= p.interference <= 1
    assert p.input_samples_per_s is not None and p.input_samples_per_s > 0
    pairs = {(t, n) for t in sync.SYNC_TRANSPORTS for n in (1, 2)}
    assert {(c.transport, c.world_size) for c in p.sync} == pairs
    assert all(c.bucket_bytes == tuple(b.nbytes for b in p.buckets()) for c in p.sync)
    with pytest.raises(ValueError, match="--model"):
        measure("resnet", 16)


def test_a_profile_from_numbers_is_named_by_its_size():
    numbers = dict(params=138_400_000, bytes_per_param=4, step_compute_ms=416, backward_fraction=0.67)
    assert explicit(**numbers, per_worker_batch=64).model == "138.4 M parameters"  # titles, headers
    assert explicit(**numbers, per_worker_batch=64, model="VGG-16").model == "VGG-16"


def test_the_device_flag_is_checked_with_one_line(monkeypatch):
    import argparse

    import torch

    from dpscale.cli.predict import add_profile_arguments
    from dpscale.errors import ConfigError
    from dpscale.flags import dataclass_kwargs
    from dpscale.lab.predict.profile import ProfileConfig

    parser = argparse.ArgumentParser()
    add_profile_arguments(parser)
    args = parser.parse_args(["--model", "mlp", "--device", "cpu"])
    assert ProfileConfig(**dataclass_kwargs(args, ProfileConfig)).device == "cpu"
    assert ProfileConfig(model="mlp").device == "cpu"  # the default, as before
    with pytest.raises(ConfigError, match="--device: cpu or cuda, got 'tpu'"):
        ProfileConfig(model="mlp", device="tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="--device cuda: no CUDA device here"):
        ProfileConfig(model="mlp", device="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ProfileConfig(model="mlp", device="cuda").device == "cuda"
    with pytest.raises(ConfigError, match="--co-located: measured on CPU workers only"):
        ProfileConfig(model="mlp", device="cuda", co_located=2)


def test_a_profile_on_a_gpu_is_timed_by_the_events_it_records(monkeypatch):
    # fake CUDA events (support/fake_events.py) stand for the GPU: each records the next whole ms,
    # so every phase the profile reports must be a whole number of ms, as the events say
    import itertools

    import torch.distributed as dist

    from dpscale.engine.clock import EventClock
    from dpscale.lab.predict import profiling
    from support.fake_events import FakeDevice

    device = FakeDevice(itertools.count())
    device.run_until()
    monkeypatch.setattr(profiling, "clock_for", lambda dev: EventClock(device.event))
    monkeypatch.setattr(profiling, "MIN_TIMED_S", 0.0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        raw = profiling._rank_measure(0, 1, "mlp", 4, 2, 0, "cpu")
    finally:
        dist.destroy_process_group()
    assert raw["phases"] and device.recorded
    for forward_ms, backward_ms, optimizer_ms, ready in raw["phases"]:
        assert all(v >= 1 and v == int(v) for v in (forward_ms, backward_ms, optimizer_ms))
        assert all(r == int(r) and r <= backward_ms for r in ready)  # each gradient within backward
