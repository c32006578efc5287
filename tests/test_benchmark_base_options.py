"""The benchmarks' options that change what is compared: engine_ab.py's --no-noise-scale,
per_parameter.py's --base (the scripts themselves run rarely)."""

import sys

import pytest
import torch.distributed as dist
from torch import nn

from dpscale import DistributedDataParallel
from support.benchmark_module import BENCHMARKS, load_benchmark


def load(name: str, monkeypatch):
    return load_benchmark(BENCHMARKS / f"{name}.py", f"_bench_{name}", monkeypatch)


@pytest.fixture
def engine_ab(monkeypatch):
    return load("engine_ab", monkeypatch)


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_no_noise_scale_turns_dpscales_measurement_off(engine_ab, one_rank):
    for noise_scale in (True, False):
        ddp = engine_ab._wrap_base("head", nn.Linear(2, 2), "gloo", noise_scale)
        assert (ddp.noise_scale is not None) is noise_scale
        ddp.close()


def test_no_noise_scale_without_base_is_refused_in_one_line(engine_ab, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["engine_ab.py", "--no-noise-scale"])
    with pytest.raises(SystemExit) as exit_:
        engine_ab.main()
    assert exit_.value.code == 2
    assert "--no-noise-scale needs --base" in capsys.readouterr().err


def test_per_parameter_with_a_base_engine_times_it_against_torch_and_head(monkeypatch, one_rank):
    per_parameter = load("per_parameter", monkeypatch)
    monkeypatch.setattr(per_parameter, "LAYERS", 2)  # 8 tensors: the bookkeeping, not the time
    result = per_parameter.run(3, 1, base_engine=DistributedDataParallel)
    assert result.base_ms > 0
    assert len(result.base_ratio) == 3 and len(result.head_over_base) == 3
    no_base = per_parameter.run(3, 1)
    assert no_base.base_ms is None and no_base.head_over_base is None
