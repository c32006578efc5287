"""All-reduce bench: documented JSON, busbw convention, correctness gate, flag parsing, report directory."""

import argparse
import contextlib
import io
import json
import math
import random
import struct
import sys
import types

import pytest
import torch

from dpscale.cli import bench as bench_cli
from dpscale.lab.bench import allreduce, allreduce_report, transports
from dpscale.lab.bench.allreduce import (
    AllReduceConfig,
    AllReducePoint,
    AllReduceResult,
    TransportCheckError,
    fit_all,
    fit_latency_bandwidth,
)
from dpscale.lab.bench.args import format_size, parse_int_list, parse_size, parse_size_list
from dpscale.lab.bench.report import Image, ReportDir, Section, markdown_table
from dpscale.lab.bench.sysinfo import collect_system_info
from dpscale.lab.bench.transports import TRANSPORTS, RankTransport, TransportSpec

POINT_KEYS = {
    "transport", "world_size", "bytes", "time_us", "algbw_GBps", "busbw_GBps", "time_us_p10", "time_us_p90",
}  # fmt: skip
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_cli.add_bench_arguments(allreduce_report.BENCH, parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """One small sweep through the command-line entry point, shared by the tests that read it."""
    base = tmp_path_factory.mktemp("reports")
    flags = [
        "--transport",
        "gloo",
        "--world-sizes",
        "1,2",
        "--sizes",
        "4,64K",
        "--iters",
        "5",
        "--json",
        "--report-dir",
        str(base),
    ]
    args = _parse(flags)
    out, err = io.StringIO(), io.StringIO()
    # Pretend this machine has one core so that world size 2 must print the oversubscription warning;
    # only the bench's own `os` is replaced, the ranks and the report see the real machine.
    one_core = types.SimpleNamespace(cpu_count=lambda: 1)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(allreduce, "os", one_core)
            mp.setattr(sys, "argv", ["/usr/bin/dpscale", "bench", "allreduce", *flags])
            rc = bench_cli.run_bench(allreduce_report.BENCH, args)
    (report_dir,) = base.iterdir()
    return types.SimpleNamespace(rc=rc, stdout=out.getvalue(), stderr=err.getvalue(), report_dir=report_dir)


@pytest.mark.slow
def test_json_line_is_exactly_the_documented_points(cli_run):
    assert cli_run.rc == 0
    points = json.loads(cli_run.stdout.strip().splitlines()[-1])
    assert [(p["world_size"], p["bytes"]) for p in points] == [(1, 4), (1, 65536), (2, 4), (2, 65536)]
    for p in points:
        assert set(p) == POINT_KEYS
        assert p["transport"] == "gloo"
        assert p["time_us"] > 0 and math.isfinite(p["time_us"])
        assert 0 < p["time_us_p10"] <= p["time_us"] <= p["time_us_p90"]
        # the nccl-tests convention: algbw = bytes / time, busbw = algbw * 2(n-1)/n (0 at n = 1)
        n = p["world_size"]
        assert p["algbw_GBps"] == pytest.approx(p["bytes"] / (p["time_us"] * 1e-6) / 1e9, rel=1e-12)
        assert p["busbw_GBps"] == pytest.approx(p["algbw_GBps"] * 2 * (n - 1) / n, rel=1e-12, abs=0)
    assert "busbw = algbw * 2(n-1)/n" in cli_run.stdout
    assert "warning: world size 2 > 1 logical cores" in cli_run.stderr
    assert "warning: world size 1" not in cli_run.stderr
    assert f"report: {cli_run.report_dir}" in cli_run.stdout


@pytest.mark.slow
def test_report_json_round_trips_and_holds_system_and_fits(cli_run):
    doc = json.loads((cli_run.report_dir / "report.json").read_text())
    assert {"command", "argv", "config", "system", "results"} <= set(doc)
    assert doc["command"] == "allreduce"
    assert set(doc["system"]) == {"hostname", "timestamp_utc", "hardware", "software"}
    results = doc["results"]
    assert set(results) == {"config", "points", "fits"}
    assert results["config"] == {
        "transports": ["gloo"],
        "world_sizes": [1, 2],
        "sizes_bytes": [4, 65536],
        "iters": 5,
    }
    assert [set(p) for p in results["points"]] == [POINT_KEYS] * 4
    (fit,) = results["fits"]  # one per (transport, world size > 1)
    assert set(fit) == {"transport", "world_size", "alpha_us", "beta_GBps", "points", "rms_rel_error"}
    assert (fit["transport"], fit["world_size"], fit["points"]) == ("gloo", 2, 2)
    assert AllReduceResult.from_dict(results).to_dict() == results


@pytest.mark.slow
def test_report_directory_has_markdown_csv_and_readable_pngs(cli_run):
    d = cli_run.report_dir
    assert d.name.endswith("-allreduce") and len(d.name.split("-")[0]) == len("20261129T183012Z")
    assert {"report.md", "report.json", "allreduce.csv", "allreduce_busbw.png"} <= {
        f.name for f in d.iterdir()
    }
    csv_lines = (d / "allreduce.csv").read_text().splitlines()
    header = "transport,world_size,bytes,time_us,algbw_GBps,busbw_GBps,time_us_p10,time_us_p90"
    assert csv_lines[0] == header and len(csv_lines) == 5
    for png in d.glob("*.png"):
        head = png.read_bytes()[:24]
        assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR", png
        width, height = struct.unpack(">II", head[16:24])
        assert 600 <= width <= 2000 and 400 <= height <= 1500, (png, width, height)
    md = (d / "report.md").read_text()
    order = [md.index(h) for h in ("## System", "**Hardware:**", "**Software:**", "## Command", "## Results")]
    assert order == sorted(order), "the report opens with hardware, software, then the command line"
    command = (
        f"dpscale bench allreduce --transport gloo --world-sizes 1,2 --sizes 4,64K --iters 5 --json "
        f"--report-dir {d.parent}"
    )
    assert f"```\n{command}\n```" in md
    assert "| gloo | 2 | 64K | 65536 |" in md
    assert "![bus bandwidth vs message size](allreduce_busbw.png)" in md


def wrong_setup(rank: int, world_size: int) -> RankTransport:
    # Scales instead of summing: right at world size 1, wrong at 2 (rank 0 gets 2, not 3).
    return RankTransport(all_reduce=lambda t: t.mul_(world_size), close=lambda: None)


@pytest.mark.slow
def test_a_transport_with_wrong_sums_cannot_report_times(monkeypatch):
    monkeypatch.setitem(TRANSPORTS, "wrong", TransportSpec(wrong_setup, "scales instead of summing"))
    config = AllReduceConfig(transports=["gloo", "wrong"], world_sizes=[2], sizes_bytes=[64], iters=2)
    with pytest.raises(TransportCheckError, match=r"'wrong', world size 2, 64 bytes: rank 0: expected .* 3"):
        allreduce.run(config)


@pytest.mark.slow
def test_adaptive_iterations_and_size_rounding():
    # sizes below one float32 element round up to one; 5 and 6 bytes both reduce one element
    result = allreduce.run(AllReduceConfig(world_sizes=[1], sizes_bytes=[6, 1, 5, 8]))
    assert [p.bytes for p in result.points] == [4, 8]
    assert result.fits == []  # world size 1 moves no data: nothing to fit


def test_size_and_list_parsing():
    assert parse_size("4") == 4 and parse_size("4B") == 4
    assert parse_size("4K") == 4096 and parse_size("16m") == 16 << 20 and parse_size("1GiB") == 1 << 30
    assert parse_size_list("4K, 16M") == [4096, 16 << 20]
    assert [format_size(s) for s in (4, 1024, 1536, 64 << 20, 2 << 30)] == ["4B", "1K", "1.5K", "64M", "2G"]
    assert parse_int_list("1,2,8", flag="--world-sizes", minimum=1) == [1, 2, 8]
    for bad in ("12Q", "K", "-4", "1.5M", "0"):
        with pytest.raises(ValueError, match="^--sizes: "):
            parse_size_list(bad)
    with pytest.raises(ValueError, match="^--sizes: .*empty entry"):
        parse_size_list("4,,8")


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--sizes", "12Q"], "--sizes"),
        (["--world-sizes", "0"], "--nproc"),
        (["--world-sizes", "1,two"], "--nproc"),
        (["--world-sizes", "2,2"], "--nproc"),
        (["--transport", "carrier-pigeon"], "--transport"),
        (["--iters", "0"], "--iters"),
    ],
)
def test_bad_flags_raise_one_line_value_errors_naming_the_flag(argv, flag):
    with pytest.raises(ValueError) as err:
        bench_cli.bench_config(allreduce_report.BENCH, _parse(argv))
    assert str(err.value).startswith(flag + ":") and "\n" not in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="nccl is usable here")
def test_nccl_without_cuda_is_refused_by_name():
    with pytest.raises(ValueError, match="^--transport: nccl cannot run at world size 1: .*CUDA"):
        bench_cli.bench_config(allreduce_report.BENCH, _parse(["--transport", "nccl", "--world-sizes", "1"]))


def test_fit_recovers_alpha_and_beta_from_synthetic_points():
    alpha_us, beta_GBps = 250.0, 1.2
    sizes = [4 * 4**k for k in range(13)]
    rng = random.Random(0)
    # 2% multiplicative noise, the scale of run-to-run jitter on a quiet machine
    times = [(alpha_us + b / (beta_GBps * 1e3)) * (1 + rng.uniform(-0.02, 0.02)) for b in sizes]
    alpha, beta, rms = fit_latency_bandwidth(sizes, times)
    assert alpha == pytest.approx(alpha_us, rel=0.03) and beta == pytest.approx(beta_GBps, rel=0.03)
    assert rms < 0.03
    exact = [AllReducePoint.from_time("x", 4, b, alpha_us + b / (beta_GBps * 1e3)) for b in sizes]
    single = [AllReducePoint.from_time("x", 1, b, 10.0) for b in sizes]
    (fit,) = fit_all(exact + single)
    assert (fit.world_size, fit.points) == (4, 13)
    assert fit.alpha_us == pytest.approx(alpha_us, rel=1e-9) and fit.beta_GBps == pytest.approx(
        beta_GBps, rel=1e-9
    )
    assert fit_latency_bandwidth([4, 64], [10.0, 10.0])[1] is None  # flat: no bandwidth term


@pytest.mark.slow
def test_report_dirs_are_unique_and_markdown_tables_render(tmp_path):
    a = ReportDir.create(tmp_path, "allreduce", argv=["dpscale", "bench", "allreduce"])
    b = ReportDir.create(tmp_path, "allreduce", argv=["dpscale", "bench", "allreduce"])
    assert a.path != b.path and a.path.is_dir() and b.path.is_dir()
    table = markdown_table(
        [{"name": "a|b", "x": 1.23456}, {"name": "c", "x": None}],
        ["name", "x"],
        {"x": ".2f"},
        {"x": "x (us)"},
    )
    assert table.splitlines() == ["| name | x (us) |", "|:---|---:|", "| a\\|b | 1.23 |", "| c | - |"]
    with pytest.raises(ValueError, match="missing.png"):
        a.write_markdown("t", [Section("Plots", [Image("missing.png", "nothing")])])
    with pytest.raises(ValueError, match="command"):
        ReportDir.create(tmp_path, "../escape")


@pytest.mark.slow
def test_system_info_names_hardware_and_software():
    info = collect_system_info()
    hw, sw = info["hardware"], info["software"]
    assert hw["logical_cores"] >= 1 and isinstance(hw["cpu_model"], str) and isinstance(hw["gpus"], list)
    assert sw["torch"] == torch.__version__ and isinstance(sw["git_dirty"], bool)
    assert info["timestamp_utc"].endswith("Z")
    json.dumps(info, allow_nan=False)


def test_default_transports_are_every_one_available_here():
    assert (
        bench_cli.bench_config(allreduce_report.BENCH, _parse([])).transports
        == transports.available_transports()
    )
    assert "gloo" in transports.available_transports()
