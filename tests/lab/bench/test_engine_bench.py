"""`dpscale bench engine`: figures per engine and per-round ratios against torch DDP."""

import pytest

from dpscale.cli import bench as bench_cli
from dpscale.engine.factory import parse_engines
from dpscale.lab.bench import engines as engine


@pytest.mark.slow
def test_engine_bench_reports_each_engine_and_ratios_to_torch():
    res, measured = engine.run(
        "digits", world_size=2, per_worker_batch=8, engines=["dpscale", "dpscale-gloo", "torch"], steps=10
    )
    assert [f.engine for f in res.engines] == ["dpscale", "dpscale-gloo", "torch"]
    assert [f.transport for f in res.engines] == ["shm", "gloo", "gloo"]
    for f in res.engines:
        assert 0 < f.step_ms_p10 <= f.step_ms_median <= f.step_ms_p90
    assert set(res.ratios_vs_torch) == {"dpscale", "dpscale-gloo"}
    for med, p10, p90 in res.ratios_vs_torch.values():
        assert 0 < p10 <= med <= p90
    assert "dpscale/torch step-time ratio" in engine.format_result(res)
    assert engine.summarize(measured) == res


def test_unknown_engine_names_the_flag():
    with pytest.raises(ValueError, match="--engines"):
        parse_engines("dpscale,horovod")


def test_a_task_spec_that_cannot_load_fails_before_anything_runs(tmp_path, monkeypatch):
    import argparse

    parser = argparse.ArgumentParser()
    bench_cli.add_engine_arguments(parser)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="^--models: cannot load 'nowhere:make'"):
        bench_cli.run_engine(parser.parse_args(["--models", "nowhere:make"]))


def test_the_terminal_table_goes_through_the_one_renderer():
    res = engine.EngineBenchResult(
        model="mlp",
        world_size=2,
        per_worker_batch=64,
        threads_per_worker=1,
        steps=30,
        steps_per_round=5,
        engines=[engine.EngineFigures("dpscale", "shm", 1.234, 1.1, 1.5)],
        ratios_vs_torch={"dpscale": (0.5, 0.45, 0.55)},
    )
    lines = engine.format_result(res).splitlines()
    assert lines[1].split() == ["engine", "transport", "median", "ms", "p10", "ms", "p90", "ms"]
    assert lines[2].split() == ["dpscale", "shm", "1.23", "1.10", "1.50"]
    assert lines[3] == "dpscale/torch step-time ratio: 0.500 (p10 0.450, p90 0.550 over rounds)"
