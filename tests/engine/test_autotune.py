"""bucket_cap_mb="auto": every rank tries the same sizes at the same steps and keeps one; math unchanged."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dpscale import DistributedDataParallel
from dpscale.engine.autotune import CANDIDATES_MB, MEASURED_STEPS, WARMUP_STEPS, BucketAutotuner
from dpscale.engine.clock import EventClock
from dpscale.lab.multirank import run_ranks
from support.fake_events import FakeDevice

SCHEDULE = len(CANDIDATES_MB) * (WARMUP_STEPS + MEASURED_STEPS)


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))


def train(rank, world, cap, steps, accumulate):
    model = DistributedDataParallel(make_model(), bucket_cap_mb=cap, first_bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    caps = []
    for _ in range(steps):
        opt.zero_grad()
        for j in range(accumulate):
            x, y = torch.randn(8, 32, generator=g), torch.randint(0, 4, (8,), generator=g)
            if j < accumulate - 1:
                with model.no_sync():
                    nn.functional.cross_entropy(model(x), y).backward()
            else:
                nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        caps.append(model.bucket_cap_mb)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return model.autotune_decision, caps, params


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.slow
def test_auto_tries_every_candidate_then_keeps_one_and_matches_a_fixed_size(accumulate):
    steps = SCHEDULE + 3
    auto = run_ranks(train, 2, "auto", steps, accumulate)
    fixed = run_ranks(train, 2, 25.0, steps, accumulate)
    (d0, caps0, p0), (d1, caps1, p1) = auto
    assert d0 is not None and d0 == d1, "every rank must reach the same decision"
    assert d0.chosen_mb in CANDIDATES_MB and len(d0.median_step_ms) == len(CANDIDATES_MB)
    assert caps0 == caps1
    # each candidate in turn, then the chosen one
    per = WARMUP_STEPS + MEASURED_STEPS
    assert caps0[: len(CANDIDATES_MB) * per] == [c for c in CANDIDATES_MB for _ in range(per)]
    assert set(caps0[len(CANDIDATES_MB) * per :]) == {d0.chosen_mb}
    # rebuilding buckets (with accumulated gradients moved along) changes no number
    torch.testing.assert_close(p0, fixed[0][2], rtol=1e-6, atol=1e-7)
    assert torch.equal(p0, p1)


def test_bad_cap_string_is_a_value_error():
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DistributedDataParallel(make_model(), bucket_cap_mb="fast")


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_tuner_times_steps_with_the_engines_clock_and_reads_them_at_the_decision(world_of_one):
    # CUDA events (fake, with set times): each candidate's steps take 10, 4, 2 and 6 ms; the
    # device has run everything by the decision, and no time is read before it
    per_step_ms = dict(zip(CANDIDATES_MB, (10.0, 4.0, 2.0, 6.0), strict=True))
    times, t = [], 0.0
    for cap in CANDIDATES_MB:
        for _ in range(WARMUP_STEPS + MEASURED_STEPS):
            times.append(t)
            t += per_step_ms[cap]
    times.append(t)
    device = FakeDevice(times)
    tuner = BucketAutotuner(None, clock=EventClock(device.event))
    clock = tuner.clock
    for _ in range(SCHEDULE):
        tuner.on_synced_forward(clock.stamp())
    device.run_until()
    assert tuner.on_synced_forward(clock.stamp()) == 25.0
    assert tuner.decision.median_step_ms == pytest.approx([10.0, 4.0, 2.0, 6.0])
