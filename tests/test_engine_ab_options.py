"""benchmarks/engine_ab.py's options that change what is compared (the script itself runs rarely)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from torch import nn

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "engine_ab.py"


@pytest.fixture
def engine_ab(monkeypatch):
    spec = importlib.util.spec_from_file_location("_bench_engine_ab", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "_bench_engine_ab", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_no_noise_scale_turns_dpscales_measurement_off(engine_ab):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for noise_scale in (True, False):
            ddp = engine_ab._wrap_base("head", nn.Linear(2, 2), "gloo", noise_scale)
            assert ddp.reducer.measure_noise_scale is noise_scale
            ddp.close()
    finally:
        dist.destroy_process_group()


def test_no_noise_scale_without_base_is_refused_in_one_line(engine_ab, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["engine_ab.py", "--no-noise-scale"])
    with pytest.raises(SystemExit) as exit_:
        engine_ab.main()
    assert exit_.value.code == 2
    assert "--no-noise-scale needs --base" in capsys.readouterr().err
