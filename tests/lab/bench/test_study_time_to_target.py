"""The study summary's time to target and statistical efficiency: each row's own run, or "not trained"."""

import argparse
import types
from dataclasses import asdict

from dpscale.cli import bench as bench_cli
from dpscale.lab.bench.study import WEAK_COMMAND, StudyConfig, part_argv
from dpscale.lab.bench.study_summary import NOT_TRAINED, _row, missing_text, summary_rows
from dpscale.lab.bench.weak import WeakConfig, WeakResult, WeakRun


def _run(n, samples, step_ms, reached=True):
    g = 32 * n
    steps = samples // g
    return WeakRun(
        world_size=n,
        global_batch=g,
        lr=1e-3,
        reached=reached,
        steps_to_target=steps if reached else None,
        samples_to_target=samples if reached else None,
        step_ms=step_ms,
        time_to_target_s=steps * step_ms / 1e3 if reached else None,
        samples_per_s=g / step_ms * 1e3,
        gns_at_target=None,
        checks=[],
        steps_run=steps,
    )


def _weak(engine, runs):
    config = WeakConfig(workload="transformer", world_sizes=[1, 2], engine=engine, target_loss=1.0)
    return WeakResult(config, runs, "train")


def _rows(weak):
    """The summary from the time-to-target runs alone (no all-reduce, scaling or convergence rows)."""
    allreduce = types.SimpleNamespace(
        points=[types.SimpleNamespace(bytes=4, transport="shm", world_size=2, busbw_GBps=1.0)]
    )
    convergence = types.SimpleNamespace(config=types.SimpleNamespace(workload="digits"), runs=[])
    return {
        (r["model"], r["engine"], r["world_size"]): r for r in summary_rows(allreduce, [], convergence, weak)
    }


def test_each_row_takes_its_own_engines_and_ns_run():
    rows = _rows(
        [
            _weak("dpscale", [_run(1, 640, 100.0), _run(2, 768, 150.0)]),
            _weak("torch", [_run(1, 704, 110.0), _run(2, 1024, 160.0, reached=False)]),
        ]
    )
    dp2 = rows[("transformer", "dpscale", 2)]
    assert (dp2["time_to_target_s"], dp2["statistical_efficiency"]) == (12 * 150.0 / 1e3, 640 / 768)
    assert (dp2["convergence_target"], dp2["convergence_status"]) == ("train loss <= 1", "reached")
    torch1 = rows[("transformer", "torch", 1)]
    assert torch1["time_to_target_s"] == 22 * 110.0 / 1e3 and torch1["statistical_efficiency"] == 1.0
    torch2 = rows[("transformer", "torch", 2)]  # missed: nothing borrowed from dpscale's N=2
    assert torch2["convergence_status"] == "not reached" and torch2["time_to_target_s"] is None
    assert torch2["statistical_efficiency"] is None
    assert missing_text(torch2, "time_to_target_s") == "not reached"
    untrained = _row("transformer", "local", 2)
    assert untrained["time_to_target_s"] is None and untrained["convergence_status"] is None
    assert missing_text(untrained, "time_to_target_s") == NOT_TRAINED
    assert missing_text(untrained, "statistical_efficiency") == NOT_TRAINED


def test_weak_runs_are_planned_per_model_with_a_target_and_per_trainable_engine():
    full = StudyConfig(models=("mlp", "transformer"))
    assert [(c.workload, c.engine) for c in full.weak_configs()] == [
        ("digits", "dpscale"),  # the convergence check's workload
        ("transformer", "dpscale"),
        ("transformer", "torch"),
    ]
    quick = StudyConfig(quick=True, models=("transformer", "mlp"))
    assert [(c.workload, c.engine, c.target_loss) for c in quick.weak_configs()] == [
        ("digits", "dpscale", None),
        ("transformer", "dpscale", 2.5),
    ]
    assert StudyConfig(models=("transformer",), world_sizes=(2, 4)).weak_configs() == []  # no N=1


def test_a_weak_part_records_the_command_that_reruns_it():
    config = StudyConfig(quick=True, models=("transformer",)).weak_configs()[1]
    argv = part_argv(WEAK_COMMAND, config)
    assert argv[:5] == ["dpscale", "bench", "convergence", "--mode", "weak"]
    parser = argparse.ArgumentParser()
    bench_cli.add_convergence_arguments(parser)
    assert asdict(bench_cli.weak_config(parser.parse_args(argv[3:]))) == asdict(config)
