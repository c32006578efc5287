"""dpscale's ranges in a torch.profiler the script runs (engine/profiler_ranges.py): present under a
profiler, absent (and never made) without one."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dpscale.engine import DistributedDataParallel
from dpscale.engine.profiler_ranges import EXPOSED_COMM, FORWARD, bucket_range_name, profiler_enabled


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _steps(model, n):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 16)
    for _ in range(n):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_the_engines_forward_buckets_and_exposed_wait_show_in_the_profile(world_of_one, tmp_path):
    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(16, 256), nn.Linear(256, 256), nn.Linear(256, 4)),
        bucket_cap_mb=0.1,
        first_bucket_cap_mb=0.1,
    )
    _steps(model, 1)
    buckets = len(model.reducer.buckets)
    assert buckets >= 2 and not profiler_enabled()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert profiler_enabled()
        _steps(model, 2)
    names = [e.name for e in prof.events()]
    expected = [FORWARD, EXPOSED_COMM, *(bucket_range_name(i) for i in range(buckets))]
    assert all(names.count(n) == 2 for n in expected), sorted(set(names) & set(expected))
    prof.export_chrome_trace(str(tmp_path / "t.json"))  # what users open in Perfetto
    assert bucket_range_name(buckets - 1) in (tmp_path / "t.json").read_text()
    _steps(model, 1)  # the profiler is gone: no range is opened
    assert not model.reducer.profiling and model.reducer._ranges == {}
