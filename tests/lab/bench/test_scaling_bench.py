"""Scaling bench: documented JSON, efficiency/ceiling formulas, strong mode, user models, validation, reports.

No performance number is asserted: the machine is shared and noisy. The measured runs use the tiny
`digits` and `synthetic` workloads with a handful of steps; the formulas are checked on exact inputs.
"""

import argparse
import contextlib
import io
import json
import struct
import sys
import types

import pytest

from dpscale.cli import bench as bench_cli
from dpscale.lab.bench import scaling, scaling_report
from dpscale.lab.bench.report import ReportDir
from dpscale.lab.bench.scaling import (
    POINT_KEYS,
    EngineRun,
    ScalingConfig,
    ScalingResult,
    summarize,
)
from dpscale.lab.bench.scaling_report import format_table, write_report

REQUIRED_KEYS = {
    "engine",
    "transport",
    "model",
    "mode",
    "world_size",
    "per_worker_batch",
    "global_batch",
    "step_ms",
    "step_ms_p90",
    "samples_per_s",
    "efficiency",
    "comm_ms",
    "exposed_comm_ms",
}
EXTRA_KEYS = {
    "ceiling_fraction",
    "overhead_ms",
    "overlap_pct",
    "straggler_ms",
    "steps",
    "step_ms_p10",
    "hosts",
}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_cli.add_bench_arguments(scaling_report.BENCH, parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """One small weak-scaling run through the command-line entry point, shared by the tests that read it."""
    base = tmp_path_factory.mktemp("reports")
    flags = ["--model", "digits", "--world-sizes", "1,2", "--steps", "6", "--warmup", "1"]
    flags += ["--json", "--report-dir", str(base)]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        with pytest.MonkeyPatch.context() as mp:
            # One core here, so world size 2 must warn; the ranks see the real machine.
            mp.setattr(scaling, "usable_cores", lambda: 1)
            mp.setattr(sys, "argv", ["/usr/bin/dpscale", "bench", "scaling", *flags])
            rc = bench_cli.run_bench(scaling_report.BENCH, _parse(flags))
    (report_dir,) = base.iterdir()
    return types.SimpleNamespace(rc=rc, stdout=out.getvalue(), stderr=err.getvalue(), report_dir=report_dir)


@pytest.mark.slow
def test_json_line_has_the_documented_keys_and_consistent_figures(cli_run):
    assert cli_run.rc == 0
    points = json.loads(cli_run.stdout.strip().splitlines()[-1])
    assert set(POINT_KEYS) == REQUIRED_KEYS | EXTRA_KEYS
    assert [(p["world_size"], p["engine"]) for p in points] == [
        (n, e) for n in (1, 2) for e in ("dpscale", "torch", "local")
    ]
    by = {(p["engine"], p["world_size"]): p for p in points}
    for p in points:
        assert set(p) == set(POINT_KEYS)
        assert (p["model"], p["mode"], p["per_worker_batch"], p["steps"]) == ("digits", "weak", 64, 6)
        assert p["global_batch"] == 64 * p["world_size"]
        assert 0 < p["step_ms_p10"] <= p["step_ms"] <= p["step_ms_p90"] and p["straggler_ms"] >= 0
        assert p["samples_per_s"] == pytest.approx(p["global_batch"] / (p["step_ms"] / 1e3), rel=1e-12)
        # efficiency against the same engine's world-size-1 throughput
        one = by[(p["engine"], 1)]
        expected = p["samples_per_s"] / (p["world_size"] * one["samples_per_s"])
        assert p["efficiency"] == pytest.approx(expected, rel=1e-12)
        local = by[("local", p["world_size"])]
        assert p["ceiling_fraction"] == pytest.approx(p["samples_per_s"] / local["samples_per_s"], rel=1e-12)
        assert p["overhead_ms"] == pytest.approx(p["step_ms"] - local["step_ms"], abs=1e-12)
        if p["engine"] in ("dpscale", "torch"):  # torch's from its _get_ddp_logging_data()
            assert p["transport"] in (("gloo", "shm") if p["engine"] == "dpscale" else ("gloo",))
            assert p["comm_ms"] > 0 and p["exposed_comm_ms"] >= 0  # medians: exposed may pass comm
            assert 0 <= p["overlap_pct"] <= 100
        else:  # local communicates nothing
            assert p["comm_ms"] is p["exposed_comm_ms"] is p["overlap_pct"] is None
            assert p["transport"] == "none"
    assert by[("local", 1)]["efficiency"] == 1.0 and by[("local", 2)]["ceiling_fraction"] == 1.0
    assert "warning: world size 2 x 1 thread(s) > 1 usable cores" in cli_run.stderr
    assert "warning: world size 1" not in cli_run.stderr
    assert f"report: {cli_run.report_dir}" in cli_run.stdout


@pytest.mark.slow
def test_report_directory_has_json_csv_markdown_and_valid_pngs(cli_run):
    d = cli_run.report_dir
    assert d.name.endswith("-scaling")
    assert {
        "report.md",
        "report.json",
        "scaling.csv",
        "scaling_throughput.png",
        "scaling_efficiency.png",
    } <= {f.name for f in d.iterdir()}
    csv_lines = (d / "scaling.csv").read_text().splitlines()
    assert csv_lines[0] == ",".join(POINT_KEYS) and len(csv_lines) == 7
    for png in d.glob("*.png"):
        head = png.read_bytes()[:24]
        assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR", png
        width, height = struct.unpack(">II", head[16:24])
        assert 600 <= width <= 2000 and 400 <= height <= 1500, (png, width, height)
    md = (d / "report.md").read_text()
    order = [md.index(h) for h in ("## System", "**Hardware:**", "## Command", "## Results", "## Plots")]
    assert order == sorted(order)
    assert "dpscale bench scaling --model digits --world-sizes 1,2" in md
    assert "| engine | transport | N | hosts |" in md and "| local | none | 2 | 1 | 64 | 128 |" in md
    assert "![throughput vs workers](scaling_throughput.png)" in md


@pytest.mark.slow
def test_results_round_trip_and_re_render_from_json(cli_run, tmp_path):
    doc = json.loads((cli_run.report_dir / "report.json").read_text())
    assert doc["command"] == "scaling" and set(doc["results"]) == {"config", "points", "runs"}
    result = ScalingResult.from_dict(doc["results"])
    assert result.to_dict() == doc["results"]
    # the kept raw per-step per-rank times reproduce every figure
    assert [vars(p) for p in summarize(result.config, result.runs)] == doc["results"]["points"]
    assert [len(r.step_ms[0]) for r in result.runs] == [1, 1, 1, 2, 2, 2]
    assert "local" in format_table(result) and "efficiency" in format_table(result)
    again = ReportDir.create(tmp_path, "scaling", argv=["dpscale", "report"])
    write_report(result, again)
    assert json.loads((again.path / "report.json").read_text())["results"] == doc["results"]
    assert (again.path / "scaling_efficiency.png").read_bytes()[:8] == PNG_SIGNATURE


def _run(engine: str, n: int, step_ms: list[list[float]], comm=None, exposed=None) -> EngineRun:
    return EngineRun(engine, n, "gloo" if engine != "local" else "none", step_ms, comm, exposed)


def test_figures_from_exact_step_times():
    config = ScalingConfig(world_sizes=[1, 2], engines=["dpscale", "local"], steps=3, per_worker_batch=10)
    runs = [
        _run("dpscale", 1, [[10.0], [20.0], [10.0]], comm=[4.0, 2.0, 2.0], exposed=[1.0, 1.0, 3.0]),
        _run("local", 1, [[5.0], [5.0], [5.0]]),
        # the slowest rank counts: step times 20, 20, 40 -> median 20; stragglers 10, 0, 30 -> 10
        _run("dpscale", 2, [[10.0, 20.0], [20.0, 20.0], [40.0, 10.0]]),
        _run("local", 2, [[8.0, 8.0], [8.0, 8.0], [8.0, 8.0]]),
    ]
    d1, l1, d2, l2 = summarize(config, runs)
    assert (d1.step_ms, d1.samples_per_s, d1.efficiency) == (10.0, 1000.0, 1.0)
    assert (d1.comm_ms, d1.exposed_comm_ms, d1.overlap_pct) == (2.0, 1.0, 50.0)
    assert (d2.step_ms, d2.step_ms_p90, d2.straggler_ms, d2.global_batch) == (20.0, 40.0, 10.0, 20)
    assert d2.samples_per_s == 1000.0 and d2.efficiency == 0.5  # 1000 / (2 * 1000)
    assert d2.ceiling_fraction == pytest.approx(8.0 / 20.0) and d2.overhead_ms == 12.0
    assert d2.comm_ms is None and d2.overlap_pct is None
    assert l1.ceiling_fraction == 1.0 and l2.overhead_ms == 0.0
    # without world size 1 there is nothing to scale against; without local, no ceiling
    (only2,) = summarize(ScalingConfig(world_sizes=[2], engines=["dpscale"]), [runs[2]])
    assert only2.efficiency is None and only2.ceiling_fraction is None and only2.overhead_ms is None


@pytest.mark.slow
def test_strong_mode_splits_the_global_batch_and_user_models_load(tmp_path, monkeypatch):
    (tmp_path / "user_scaling_model.py").write_text(
        "import torch, dpscale\n"
        "from torch.utils.data import TensorDataset\n"
        "def tiny():\n"
        "    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 4, (64,)))\n"
        "    loss = lambda out, y: torch.nn.functional.cross_entropy(out, y, reduction='none')\n"
        "    return dpscale.Task(model=lambda: torch.nn.Linear(8, 4), train_data=data, loss=loss)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # the ranks get the parent's sys.path
    config = ScalingConfig(
        model="user_scaling_model:tiny",
        mode="strong",
        global_batch=32,
        world_sizes=[1, 2],
        engines=["dpscale", "local"],
        steps=2,
        warmup=0,
    )
    result = scaling.run(config)
    assert [(p.world_size, p.per_worker_batch, p.global_batch) for p in result.points] == [
        (1, 32, 32),
        (1, 32, 32),
        (2, 16, 32),
        (2, 16, 32),
    ]
    assert {p.mode for p in result.points} == {"strong"}
    # a bare module is not a Task: the one meaning of module:callable everywhere
    with pytest.raises(ValueError, match="returned DigitsNet; it must return a dpscale.Task"):
        scaling.run(
            ScalingConfig(model="dpscale.workloads.models:DigitsNet", world_sizes=[1], engines=["local"])
        )


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--model", "nope"], "--model"),
        (["--model", ":fn"], "--model"),
        (["--mode", "medium"], "--mode"),
        (["--global-batch", "64"], "--global-batch"),  # weak mode fixes the per-worker batch
        (["--mode", "strong"], "--global-batch"),  # strong mode needs one
        (["--mode", "strong", "--global-batch", "64", "--world-sizes", "1,3"], "--global-batch"),
        (["--mode", "strong", "--global-batch", "64", "--per-worker-batch", "8"], "--per-worker-batch"),
        (["--per-worker-batch", "0"], "--per-worker-batch"),
        (["--world-sizes", "0"], "--nproc"),
        (["--world-sizes", "2,2"], "--nproc"),
        (["--engines", "horovod"], "--engines"),
        (["--steps", "0"], "--steps"),
        (["--warmup", "-1"], "--warmup"),
        (["--threads-per-worker", "0"], "--threads-per-worker"),
    ],
)
def test_bad_flags_raise_one_line_value_errors_naming_the_flag(argv, flag):
    with pytest.raises(ValueError) as err:
        bench_cli.bench_config(scaling_report.BENCH, _parse(argv))
    assert str(err.value).startswith(flag) and "\n" not in str(err.value)


def test_not_divisible_names_a_multiple_and_bad_user_models_fail_before_any_rank_starts():
    with pytest.raises(ValueError, match="not divisible by world size 3; use a multiple of 12"):
        ScalingConfig(mode="strong", global_batch=64, world_sizes=[1, 3, 4])
    for spec in (
        "no_such_module_xyz:make",
        "dpscale.workloads.models:no_such_fn",
        "builtins:dict",
        "dpscale.workloads.models:math",
    ):
        with pytest.raises(ValueError, match="^--model: "):
            scaling.run(ScalingConfig(model=spec, world_sizes=[1], engines=["local"], steps=1))
