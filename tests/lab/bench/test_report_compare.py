"""`dpscale report`: re-render a report from report.json alone, compare reports A/B, refuse bad input."""

import argparse
import json
import shutil

import pytest

from dpscale.cli import report as report_cli
from dpscale.lab.bench import allreduce, allreduce_report, benches, compare, rerender
from dpscale.lab.bench.allreduce import AllReduceConfig
from dpscale.lab.bench.convergence import ConvergenceResult
from dpscale.lab.bench.convergence_report import write_report as write_convergence
from dpscale.lab.bench.report import ReportDir

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    report_cli.add_report_arguments(parser)
    return report_cli.run_report(parser.parse_args(argv))


@pytest.fixture(scope="module")
def allreduce_reports(tmp_path_factory):
    """Two real, tiny all-reduce runs (world size 1, 4 B and 64 KiB, 3 iterations), each in a report."""
    base = tmp_path_factory.mktemp("reports")
    dirs = []
    for _ in range(2):
        result = allreduce.run(AllReduceConfig(world_sizes=[1], sizes_bytes=[4, 65536], iters=3))
        report = ReportDir.create(base, "allreduce", argv=["dpscale", "bench", "allreduce", "--iters", "3"])
        allreduce_report.write_report(result, report)
        dirs.append(report.path)
    return dirs


@pytest.mark.slow
def test_rerender_restores_markdown_and_plots_from_report_json_alone(allreduce_reports, capsys):
    d = allreduce_reports[0]
    md_before, json_before = (d / "report.md").read_text(), (d / "report.json").read_text()
    for f in [d / "report.md", *d.glob("*.png"), *d.glob("*.csv")]:
        f.unlink()
    assert _run([str(d)]) == 0
    assert f"re-rendered {d / 'report.md'}" in capsys.readouterr().out
    # the original run's system and command line, not this process's: byte for byte the same report
    assert (d / "report.md").read_text() == md_before
    assert (d / "report.json").read_text() == json_before
    for name in ("allreduce_busbw.png", "allreduce_latency.png"):
        assert (d / name).read_bytes()[:8] == PNG_SIGNATURE
    assert (d / "allreduce.csv").is_file()


@pytest.mark.slow
def test_two_allreduce_reports_compare_per_transport_world_size_and_size(allreduce_reports, capsys):
    a, b = allreduce_reports
    assert _run([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert f"A: {a}" in out and f"B: {b}" in out and "busbw_GBps B/A" in out
    (out_dir,) = a.parent.glob("compare-*")
    assert f"report: {out_dir}" in out
    doc = json.loads((out_dir / "compare.json").read_text())
    assert set(doc) == {"command", "baseline", "reports", "key_columns", "metrics", "rows", "warnings"}
    assert doc["warnings"] == []  # one machine, one setup
    assert (doc["command"], doc["baseline"]) == ("allreduce", "A")
    assert [r["label"] for r in doc["reports"]] == ["A", "B"]
    assert doc["key_columns"] == ["transport", "world_size", "bytes"]
    assert doc["metrics"] == ["time_us", "busbw_GBps"]
    assert [r["key"] for r in doc["rows"]] == [
        {"transport": "gloo", "world_size": 1, "bytes": 4},
        {"transport": "gloo", "world_size": 1, "bytes": 65536},
    ]
    points = [json.loads((d / "report.json").read_text())["results"]["points"] for d in (a, b)]
    for row, pa, pb in zip(doc["rows"], *points, strict=True):
        assert row["values"]["time_us"] == [pa["time_us"], pb["time_us"]]
        assert row["ratios"]["time_us"] == [pytest.approx(pb["time_us"] / pa["time_us"])]
        assert row["ratios"]["busbw_GBps"] == [None]  # world size 1: busbw is 0, no ratio to a zero
    md = (out_dir / "report.md").read_text()
    assert "### A:" in md and "### B:" in md and "**Hardware:**" in md and "time_us: lower is better" in md
    assert (
        (out_dir / "compare.csv")
        .read_text()
        .splitlines()[0]
        .startswith("transport,world_size,bytes,time_us A")
    )


def _convergence_results(final_loss_2: float) -> dict:
    losses = [2.0, 1.5, 1.2, 1.0]

    def run(w: int, last: float) -> dict:
        return {
            "world_size": w, "accumulation_steps": 2 // w, "micro_batch": 32, "steps": 4, "samples": 256,
            "final_loss": last, "test_accuracy": 0.8, "param_sha256": "0" * 64, "wall_s": 1.0,
            "samples_per_s": 500.0, "samples_seen": [64, 128, 192, 256], "losses": [*losses[:3], last],
            "max_gap": 0.0, "max_rel_gap": 0.0, "within_tolerance": True,
        }  # fmt: skip

    return {
        "config": {"workload": "digits", "world_sizes": [1, 2], "global_batch": 64, "samples": 256,
                   "seed": 0, "tolerance": 0.05},
        "reference_world_size": 1, "smoothing_window_steps": 1, "compared_from_step": 3,
        "runs": [run(1, 1.0), run(2, final_loss_2)],
    }  # fmt: skip


def _convergence_report(base, final_loss_2: float):
    result = ConvergenceResult.from_dict(_convergence_results(final_loss_2))
    report = ReportDir.create(base, "convergence", argv=["dpscale", "bench", "convergence"])
    write_convergence(result, report)
    return report.path


@pytest.mark.slow
def test_convergence_reports_rerender_and_compare_final_loss_per_world_size(tmp_path, capsys):
    a, b = _convergence_report(tmp_path, 1.0), _convergence_report(tmp_path, 1.1)
    (a / "convergence.png").unlink()
    assert _run([str(a)]) == 0
    assert (a / "convergence.png").read_bytes()[:8] == PNG_SIGNATURE
    out_dir = tmp_path / "ab"
    assert _run([str(a), str(b), "--out", str(out_dir)]) == 0
    assert "final_loss B/A" in capsys.readouterr().out
    doc = json.loads((out_dir / "compare.json").read_text())
    assert [r["key"] for r in doc["rows"]] == [{"world_size": 1}, {"world_size": 2}]
    assert doc["rows"][1]["values"]["final_loss"] == [1.0, 1.1]
    assert doc["rows"][1]["ratios"]["final_loss"] == [pytest.approx(1.1)]
    assert "| 2 | 1 | 1.1 | 1.100 |" in (out_dir / "report.md").read_text()


def _write_report_json(directory, command: str, results) -> str:
    directory.mkdir()
    doc = {"command": command, "config": None, "system": None, "results": results, "command_line": "x"}
    (directory / "report.json").write_text(json.dumps(doc))
    return str(directory)


def _scaling_point(engine: str, transport: str, world_size: int, batch: int, samples_per_s: float) -> dict:
    return {
        "engine": engine, "transport": transport, "model": "mlp", "mode": "weak", "world_size": world_size,
        "per_worker_batch": batch, "global_batch": batch * world_size, "step_ms": 10.0, "step_ms_p90": 11.0,
        "samples_per_s": samples_per_s, "efficiency": 0.9, "comm_ms": None, "exposed_comm_ms": None,
    }  # fmt: skip


def test_scaling_points_match_on_engine_and_world_size_in_either_layout(tmp_path, capsys):
    # A lists its points under "points", B as a bare list; dpscale's transport differs (the A/B
    # question itself), so transport must not split the rows. A has two batches per (engine, N),
    # so the per-worker batch joins the key.
    a_points = [_scaling_point("dpscale", "shm", 2, b, 100.0 * b) for b in (32, 64)]
    b_points = [_scaling_point("dpscale", "gloo", 2, b, 150.0 * b) for b in (32, 64)]
    a = _write_report_json(tmp_path / "a", "scaling", {"config": {}, "points": a_points, "runs": []})
    b = _write_report_json(tmp_path / "b", "scaling", b_points)
    comparison = compare.compare([a, b])
    assert comparison.key_columns == ["engine", "world_size", "per_worker_batch"]
    assert [r["ratios"]["samples_per_s"] for r in comparison.rows] == [[pytest.approx(1.5)]] * 2
    table = compare.format_comparison(comparison)
    assert "samples_per_s B/A" in table and "efficiency B/A" in table and "1.500" in table


def test_reports_of_different_commands_are_refused_naming_both(tmp_path):
    a = _write_report_json(tmp_path / "a", "allreduce", {"points": []})
    b = _write_report_json(tmp_path / "b", "convergence", {"runs": []})
    with pytest.raises(ValueError, match=rf"allreduce report \({a}\) with a convergence report \({b}\)"):
        _run([a, b])


@pytest.mark.slow
def test_a_directory_without_report_json_is_named(tmp_path, allreduce_reports):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=rf"^{empty}: no report.json there"):
        _run([str(empty)])
    with pytest.raises(ValueError, match=rf"^{empty}: no report.json there"):
        _run([str(allreduce_reports[0]), str(empty)])


@pytest.mark.slow
def test_a_report_of_an_unknown_command_is_refused_with_the_known_ones(tmp_path, allreduce_reports):
    d = tmp_path / "copy"
    shutil.copytree(allreduce_reports[0], d)
    unknown = _write_report_json(tmp_path / "unknown", "teleport", {})
    with pytest.raises(ValueError, match=r"'teleport' cannot be re-rendered; known: allreduce"):
        _run([unknown])
    with pytest.raises(ValueError, match="^--out: only a comparison"):
        _run([str(d), "--out", str(tmp_path / "x")])


@pytest.mark.parametrize(
    "command, results, why",
    [
        ("scale", {"config": {"script": "t.py"}, "points": [{"world_size": 1}]}, "TypeError"),
        ("scale", {"points": []}, "KeyError: 'config'"),
        ("scale", [], "TypeError"),
        ("allreduce", {"points": [{"engine": "dpscale"}]}, ""),
        ("predict", {"profile": None}, ""),
    ],
)
def test_a_report_json_with_incomplete_results_is_one_line_naming_it(tmp_path, command, results, why):
    # an edited report.json, or one an older or newer dpscale wrote: not a traceback
    d = _write_report_json(tmp_path / "r", command, results)
    with pytest.raises(ValueError, match=rf"^{d}: its report.json results are not a {command} result"):
        _run([d])
    with pytest.raises(ValueError) as e:
        _run([d])
    assert why in str(e.value) and "\n" not in str(e.value)
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["report.json"]


def test_a_report_json_without_its_system_is_named(tmp_path):
    doc = {"command": "scale", "results": {"config": {"script": "t.py"}, "points": []}}
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "report.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"/r: its report.json lacks the system it was measured on"):
        _run([str(tmp_path / "r")])


@pytest.mark.parametrize("out", ["file", "file/sub"])
def test_a_comparison_out_that_cannot_be_a_directory_is_refused_before_comparing(tmp_path, capsys, out):
    a = _write_report_json(tmp_path / "a", "allreduce", {"points": []})
    b = _write_report_json(tmp_path / "b", "allreduce", {"points": []})
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ValueError, match=rf"^--out {tmp_path / out} "):
        _run([a, b, "--out", str(tmp_path / out)])
    assert capsys.readouterr().out == ""  # no table first, then the refusal


def test_compared_values_read_as_plain_numbers_at_any_size():
    # 1.121e+04 us in a column of 236.5 and 774.7 read as a typo; ratios stay fixed to 3 places
    assert compare._cell("time_us A", 11210.4) == "11,210"
    assert compare._cell("samples_per_s B", 1228.3) == "1,228"
    assert compare._cell("time_us A", 236.54) == "236.5"
    assert compare._cell("efficiency A", 0.45994) == "0.4599"
    assert compare._cell("time_us B/A", 1.5361) == "1.536"


def test_every_renderer_entry_reads_results_and_writes_a_report():
    assert set(rerender.RENDERERS) == set(benches.FIGURES)  # every comparable command re-renders too
    for command, (from_dict, write_report) in rerender.RENDERERS.items():
        assert callable(from_dict) and callable(write_report), command
