"""`dpscale report` on every report dpscale writes: the study and its parts, predict; each report's
command line runs as it stands; comparisons refuse or warn when the reports' setups differ.

data/study-quick-v0.json is the report.json of a real `dpscale study --quick` written before the
study's parts recorded runnable commands: it also checks that older reports still re-render.
"""

import argparse
import contextlib
import copy
import functools
import io
import json
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from dpscale.cli import bench as bench_cli
from dpscale.cli import predict as predict_cli
from dpscale.cli import report as report_cli
from dpscale.cli.main import build_parser
from dpscale.lab.bench import (
    allreduce_report,
    benches,
    compare,
    report,
    rerender,
    scaling_report,
    study,
    trust,
)

STUDY_V0 = json.loads((Path(__file__).parent / "data" / "study-quick-v0.json").read_text())
PARTS = {"allreduce": "allreduce", "scaling-mlp": "scaling", "convergence": "convergence"}
# how each bench's flags become its config (the CLI's own functions)
CONFIG_OF = {
    "allreduce": functools.partial(bench_cli.bench_config, allreduce_report.BENCH),
    "scaling": functools.partial(bench_cli.bench_config, scaling_report.BENCH),
    "convergence": bench_cli.convergence_config,
}

scaling_config = CONFIG_OF["scaling"]


def _report_cli(argv: list[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    report_cli.add_report_arguments(parser)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = report_cli.run_report(parser.parse_args(argv))
    return rc, out.getvalue()


def _write(directory: Path, doc: dict) -> Path:
    directory.mkdir(parents=True)
    (directory / "report.json").write_text(json.dumps(doc))
    return directory


def _parsed_config(argv: list[str]):
    """The config a recorded `dpscale bench X ...` line builds, through the real CLI parser."""
    assert argv[:2] == ["dpscale", "bench"], argv
    return CONFIG_OF[argv[2]](build_parser().parse_args(argv[1:]))


@pytest.fixture(scope="module")
def rendered_study(tmp_path_factory) -> tuple[Path, int, str]:
    """STUDY_V0 re-rendered once for the tests that read it (ten figures: seconds each time);
    a test that changes it works on a copy."""
    d = _write(tmp_path_factory.mktemp("rendered") / "study", STUDY_V0)
    return d, *_report_cli([str(d)])


def test_an_older_study_rerenders_with_every_part_and_runnable_part_commands(rendered_study, tmp_path):
    rendered, rc, out = rendered_study
    assert rc == 0 and f"re-rendered {rendered / 'report.md'}" in out
    d = Path(shutil.copytree(rendered, tmp_path / "study"))  # its parts are re-rendered below
    md = (d / "report.md").read_text()
    assert "dpscale study --quick" in md and "| mlp | dpscale | shm | 2 |" in md
    result = study.StudyResult.from_dict(STUDY_V0["results"])
    configs = {
        "allreduce": result.allreduce.config,
        "scaling": result.scaling[0].config,
        "convergence": result.convergence.config,
    }
    for folder, command in PARTS.items():
        part = json.loads((d / folder / "report.json").read_text())
        assert part["command"] == command  # not the folder's name: `dpscale report` knows it
        assert "(part of dpscale study)" not in part["command_line"]
        # the recorded line, run through the CLI's parser, builds exactly the config that was measured
        assert _parsed_config(shlex.split(part["command_line"])) == configs[command]
        assert f"```\n{part['command_line']}\n```" in (d / folder / "report.md").read_text()
        for line in (d / "report.md").read_text().splitlines():
            if line.startswith("!["):
                assert (d / line.split("](")[1].rstrip(")")).is_file(), line
        # each part on its own, too
        (d / folder / "report.md").unlink()
        assert _report_cli([str(d / folder)])[0] == 0 and (d / folder / "report.md").is_file()


def test_an_older_study_part_gets_its_command_rebuilt_from_its_config(tmp_path):
    # a part written by the older study, on its own: folder-named command, placeholder argument
    results = STUDY_V0["results"]["scaling"][0]
    argv = ["dpscale", "bench", "scaling", "--model", "mlp", "(part of dpscale study)"]
    old = {**STUDY_V0, "command": "scaling-mlp", "argv": argv, "results": results}
    d = _write(tmp_path / "scaling-mlp", old)
    assert _report_cli([str(d)])[0] == 0
    doc = json.loads((d / "report.json").read_text())
    assert doc["command"] == "scaling"
    assert _parsed_config(doc["argv"]) == study.StudyResult.from_dict(STUDY_V0["results"]).scaling[0].config


def test_config_argv_writes_every_set_field_and_round_trips_through_the_parser():
    config = study.StudyConfig(quick=True, models=("mlp",), world_sizes=(1, 2))
    for command, cfg in (
        ("allreduce", config.allreduce_config()),
        ("convergence", config.convergence_config()),
        ("scaling", config.scaling_configs()[0]),
    ):
        argv = study.part_argv(command, cfg)
        assert _parsed_config(argv) == cfg, argv
    # defaults are written too (the line must mean the same run after a default changes)
    assert "--warmup" in study.part_argv("scaling", config.scaling_configs()[0])


@pytest.mark.parametrize(
    "argv0, program",
    [
        ("/venv/bin/dpscale", ["dpscale"]),
        ("/src/dpscale/cli.py", ["dpscale"]),  # python -m dpscale.cli.main
        ("benchmarks/engine.py", ["python", "benchmarks/engine.py"]),
    ],
)
def test_a_report_records_a_command_line_that_starts_the_program_again(argv0, program, tmp_path, monkeypatch):
    monkeypatch.setattr(report, "collect_system_info", lambda: STUDY_V0["system"])
    monkeypatch.setattr(sys, "argv", [argv0, "bench", "engine", "--steps", "3"])
    r = report.ReportDir.create(tmp_path, "scaling")
    assert r.argv == [*program, "bench", "engine", "--steps", "3"]


def _predict(tmp_path: Path, monkeypatch, *flags: str) -> Path:
    monkeypatch.setattr(report, "collect_system_info", lambda: STUDY_V0["system"])  # no git process
    parser = argparse.ArgumentParser()
    predict_cli.add_predict_arguments(parser)
    argv = [*flags, "--report-dir", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", ["/venv/bin/dpscale", "predict", *argv])
    with contextlib.redirect_stdout(io.StringIO()):
        assert predict_cli.run_predict_from_args(parser.parse_args(argv)) == 0
    (d,) = [p for p in tmp_path.iterdir() if p.name.endswith("-predict")]
    return d


def test_a_predict_report_rerenders_byte_for_byte_with_a_measured_cluster(
    rendered_study, tmp_path, monkeypatch
):
    # a cluster calibrated from the study's all-reduce part: the measured times go through JSON too
    study_dir, rc, _ = rendered_study
    assert rc == 0
    explicit = ["--params", "2e6", "--step-compute-ms", "12", "--per-worker-batch", "32"]
    d = _predict(tmp_path / "p", monkeypatch, *explicit, "--calibrate", str(study_dir / "allreduce"))
    assert json.loads((d / "report.json").read_text())["results"]["cluster"]["measured"]
    before = {f.name: f.read_bytes() for f in d.iterdir() if f.suffix in (".md", ".csv", ".json")}
    for f in d.iterdir():
        if f.name != "report.json":
            f.unlink()
    assert _report_cli([str(d)])[0] == 0
    assert {f.name: f.read_bytes() for f in d.iterdir() if f.suffix in (".md", ".csv", ".json")} == before
    assert (d / "predict.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_report_command_rerenders_and_compares():
    assert {"allreduce", "scaling", "convergence", "scale", "study", "predict"} <= set(rerender.RENDERERS)
    assert set(rerender.RENDERERS) == set(benches.FIGURES)


# ---- comparing: study with study, refusing or warning where the setups differ --------------------


def _study_doc(samples_factor: float = 1.0, *, model: str = "mlp", batch: int = 64, cpu: str | None = None):
    doc = copy.deepcopy(STUDY_V0)
    for r in doc["results"]["summary"]:
        r["samples_per_s"] *= samples_factor
        r["model"] = model
    doc["results"]["scaling"][0]["config"]["per_worker_batch"] = batch
    if cpu:
        doc["system"]["hardware"]["cpu_model"] = cpu
    return doc


def test_two_studies_compare_per_model_engine_and_world_size(tmp_path):
    a = _write(tmp_path / "a", _study_doc())
    b = _write(tmp_path / "b", _study_doc(2.0))
    rc, out = _report_cli([str(a), str(b), "--out", str(tmp_path / "cmp")])
    assert rc == 0 and "warning" not in out
    comparison = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert comparison["command"] == "study" and comparison["warnings"] == []
    assert comparison["key_columns"] == ["model", "engine", "world_size"]
    assert len(comparison["rows"]) == 6
    assert all(r["ratios"]["samples_per_s"] == [pytest.approx(2.0)] for r in comparison["rows"])


def test_reports_of_different_models_are_refused_in_one_line(tmp_path):
    a = _write(tmp_path / "a", _study_doc())
    b = _write(tmp_path / "b", _study_doc(model="transformer"))
    with pytest.raises(
        ValueError, match=r"^cannot compare reports of different models \(A mlp; B transformer\)"
    ):
        compare.compare([a, b])
    # the same for two scaling parts
    parts = []
    for name, model in (("c", "mlp"), ("d", "transformer")):
        results = copy.deepcopy(STUDY_V0["results"]["scaling"][0])
        for p in results["points"]:
            p["model"] = model
        parts.append(_write(tmp_path / name, {**STUDY_V0, "command": "scaling", "results": results}))
    with pytest.raises(ValueError, match="different models"):
        compare.compare(parts)


def test_a_different_batch_or_hardware_is_compared_with_one_warning_line_each(tmp_path):
    a = _write(tmp_path / "a", _study_doc())
    b = _write(tmp_path / "b", _study_doc(batch=32, cpu="Intel Xeon"))
    rc, out = _report_cli([str(a), str(b), "--out", str(tmp_path / "cmp")])
    assert rc == 0
    warnings = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 2
    assert "batch differs (A 64/worker; B 32/worker)" in warnings[0]
    assert "hardware differs" in warnings[1] and "Intel Xeon" in warnings[1]
    md = (tmp_path / "cmp" / "report.md").read_text()
    assert "## Warnings" in md and "batch differs" in md


# ---- honest columns and trust checks ------------------------------------------------------------


def test_the_study_summary_puts_each_figure_on_its_own_row_only():
    result = study.StudyResult.from_dict(STUDY_V0["results"])
    rows = {(r["model"], r["engine"], r["world_size"]): r for r in result.summary()}
    # the convergence bench trained digits on dpscale: its gap is on those rows and nowhere else
    assert {k for k, r in rows.items() if r["convergence_gap"] is not None} == {
        ("digits", "dpscale", 1),
        ("digits", "dpscale", 2),
    }
    assert rows[("digits", "dpscale", 2)]["samples_per_s"] is None  # not measured for that row
    mlp = rows[("mlp", "torch", 2)]
    assert mlp["samples_per_s"] > 0 and mlp["busbw_GBps"] > 0 and mlp["spread"] > 0
    text = study.format_summary(result)
    line = next(line for line in text.splitlines() if line.split()[:2] == ["mlp", "local"])
    assert "n/m" in line and " - " in line  # local: its convergence not measured; no link at N=1


def test_an_older_scaling_report_gets_its_spread_from_the_steps_it_kept():
    result = study.StudyResult.from_dict(STUDY_V0["results"])
    for p in result.scaling[0].points:
        run = next(r for r in result.scaling[0].runs if (r.engine, r.world_size) == (p.engine, p.world_size))
        steps = sorted(max(s) for s in run.step_ms)
        assert steps[0] <= p.step_ms_p10 <= p.step_ms <= p.step_ms_p90
        assert p.spread == pytest.approx((p.step_ms_p90 - p.step_ms_p10) / p.step_ms)


def _trust_row(engine="dpscale", world_size=2, efficiency=0.95, overhead_ms=1.0, spread=0.05):
    return {
        "model": "mlp",
        "engine": engine,
        "world_size": world_size,
        "efficiency": efficiency,
        "overhead_ms": overhead_ms,
        "spread": spread,
    }


def test_trust_checks_warn_once_per_kind_naming_the_rows():
    assert trust.timing_warnings([_trust_row(), _trust_row("local", overhead_ms=0.0)]) == []
    assert trust.timing_warnings([_trust_row(efficiency=None, overhead_ms=None, spread=None)]) == []
    (local,) = trust.timing_warnings([_trust_row("local", efficiency=0.39, overhead_ms=0.0)])
    assert "local engine scales below 90% (mlp local N=2 39%)" in local and "host is busy" in local
    # local at N=1 is 100% by definition; a slow dpscale is what the bench measures, not a warning
    assert trust.timing_warnings([_trust_row("local", world_size=1, efficiency=0.5, overhead_ms=0.0)]) == []
    assert trust.timing_warnings([_trust_row(efficiency=0.5)]) == []
    (negative,) = trust.timing_warnings([_trust_row(world_size=1, overhead_ms=-2.5)])
    assert "negative overhead (mlp dpscale N=1 -2.50 ms)" in negative
    (spread,) = trust.timing_warnings([_trust_row(spread=0.35), _trust_row("torch", spread=0.25)])
    assert "above 20% of the median (mlp dpscale N=2 35%, mlp torch N=2 25%)" in spread


def test_trust_warnings_head_the_study_and_scaling_reports(rendered_study):
    d, rc, _ = rendered_study  # a loaded host: torch ran faster than local at N=1
    assert rc == 0
    for md in (d / "report.md", d / "scaling-mlp" / "report.md"):
        text = md.read_text()
        head = text[text.index("## Warnings") : text.index("## Summary" if md.parent == d else "## Results")]
        assert "negative overhead (mlp torch N=1 -8.08 ms)" in head, md
        assert "times spread (p10-p90) above 20%" in head, md
    assert "indicative only: --quick" in (d / "report.md").read_text()
    for folder in PARTS:  # a --quick study's parts say so too
        assert "indicative only: --quick" in (d / folder / "report.md").read_text(), folder


# ---- plots ---------------------------------------------------------------------------------------


def test_allreduce_plots_leave_out_world_size_1_and_use_log_axes():
    from dpscale.lab.bench import allreduce_report

    result = study.StudyResult.from_dict(STUDY_V0["results"]).allreduce
    for fig in (allreduce_report.plot_busbw(result.points), allreduce_report.plot_latency(result.points)):
        (ax,) = fig.axes
        assert ax.get_yscale() == "log" and ax.get_xscale() == "log"
        assert sorted(line.get_label() for line in ax.lines) == ["gloo, n=2", "shm, n=2"]


def test_allreduce_points_keep_their_spread_and_plots_draw_it():
    from dpscale.lab.bench import allreduce_report
    from dpscale.lab.bench.allreduce import AllReducePoint

    p = AllReducePoint.from_time("shm", 2, 4096, 10.0, 8.0, 13.0)
    assert p.spread == pytest.approx(0.5) and p.to_dict()["time_us_p90"] == 13.0
    q = AllReducePoint.from_time("shm", 2, 8192, 12.0, 11.0, 12.5)
    fig = allreduce_report.plot_latency([p, q])
    (band,) = fig.axes[0].collections  # the p10-p90 band
    assert band.get_paths()[0].vertices[:, 1].min() == pytest.approx(8.0)
    (warning,) = trust.timing_warnings({"label": f"shm n=2 {x.bytes}", "spread": x.spread} for x in (p, q))
    assert "(shm n=2 4096 50%)" in warning


def test_scaling_plots_name_the_transport_between_workers_and_keep_labels_apart():
    from dpscale.lab.bench import scaling_report

    result = study.StudyResult.from_dict(STUDY_V0["results"]).scaling[0]
    fig = scaling_report.plot_efficiency(result)
    (ax,) = fig.axes
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "dpscale (shm)" in labels  # not "dpscale (gloo, shm)": N=1 has no traffic between workers
    # dpscale 112% and local 111% at N=2: their labels must not overlap
    texts = {t.get_text(): t for t in ax.texts if t.get_text().endswith("%")}
    assert set(texts) == {"112%", "111%", "81%"}
    fig.canvas.draw()
    boxes = [t.get_window_extent() for t in texts.values()]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    # the p10-p90 bars are drawn, one set per engine
    assert len([c for c in ax.containers if c.has_yerr]) == 3


# ---- --config FILE.toml for study and the benches -----------------------------------------------


@pytest.mark.parametrize(
    "command, toml, expected",
    [
        (
            ["bench", "allreduce"],
            'transport = "shm,gloo"\nworld-sizes = [1, 2]\nsizes = "4,16M"\niters = 7\n',
            {"transports": ["shm", "gloo"], "world_sizes": [1, 2], "sizes_bytes": [4, 16 << 20], "iters": 7},
        ),
        (
            ["bench", "scaling"],
            'model = "digits"\nworld_sizes = "1,2"\nsteps = 12\n',
            {"model": "digits", "world_sizes": [1, 2], "steps": 12},
        ),
        (["bench", "convergence"], "samples = 256\nseed = 3\n", {"samples": 256, "seed": 3}),
    ],
)
def test_a_bench_takes_its_config_from_a_toml_file_and_flags_override_it(command, toml, expected, tmp_path):
    path = tmp_path / "bench.toml"
    path.write_text(toml)
    config_of = CONFIG_OF[command[1]]
    config = config_of(build_parser().parse_args([*command, "--config", str(path)]))
    assert {k: getattr(config, k) for k in expected} == expected
    # a flag wins over the file
    config = config_of(build_parser().parse_args([*command, "--config", str(path), "--world-sizes", "2"]))
    assert config.world_sizes == [2]


def test_the_study_takes_its_config_from_a_toml_file(tmp_path):
    path = tmp_path / "study.toml"
    path.write_text('quick = true\nmodels = ["mlp"]\nworld-sizes = "1,2,4"\n')
    args = build_parser().parse_args(["study", "--config", str(path)])
    assert report_cli.study_config(args) == study.StudyConfig(
        quick=True, models=("mlp",), world_sizes=(1, 2, 4)
    )


def test_a_bad_config_file_is_one_line_naming_the_file_and_key(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("stepz = 3\n")
    with pytest.raises(
        ValueError, match=r"^--config: .*bad.toml sets 'stepz', which is not one of its keys: model"
    ):
        scaling_config(build_parser().parse_args(["bench", "scaling", "--config", str(path)]))
    path.write_text("steps = [\n")
    with pytest.raises(ValueError, match=r"^--config: .*bad.toml is not valid TOML"):
        scaling_config(build_parser().parse_args(["bench", "scaling", "--config", str(path)]))
    with pytest.raises(ValueError, match=r"^--config: cannot read .*nowhere.toml"):
        scaling_config(
            build_parser().parse_args(["bench", "scaling", "--config", str(tmp_path / "nowhere.toml")])
        )


def test_a_table_without_rows_is_its_header():
    # two reports that share no row compare to an empty table; it must print, not raise
    from dpscale.lab.bench.report import markdown_table, text_table

    assert text_table([], ["engine", "step_ms"], styled=False) == "engine  step_ms"
    assert markdown_table([], ["engine", "step_ms"]).splitlines()[0] == "| engine | step_ms |"


def test_the_terminal_and_the_report_show_the_same_cells():
    from dpscale.lab.bench import study_summary
    from dpscale.lab.bench.report import markdown_table, text_table

    rows = study.StudyResult.from_dict(STUDY_V0["results"]).summary()
    spec = (
        rows,
        study_summary.COLUMNS,
        study_summary.FORMATS,
        study_summary.HEADERS,
        study_summary.missing_text,
    )
    md = [[c.strip() for c in line.strip("|").split("|")] for line in markdown_table(*spec).splitlines()]
    text = text_table(*spec).splitlines()
    assert len(md) == len(text) + 1  # markdown's alignment row
    for md_cells, line in zip(md[2:], text[1:], strict=True):
        assert line.split() == [w for cell in md_cells for w in cell.split()]


def test_on_a_terminal_the_table_is_drawn_by_rich_with_the_same_cells():
    import re

    from dpscale.lab.bench import study_summary
    from dpscale.lab.bench.report import text_table

    rows = study.StudyResult.from_dict(STUDY_V0["results"]).summary()
    spec = (
        rows,
        study_summary.COLUMNS,
        study_summary.FORMATS,
        study_summary.HEADERS,
        study_summary.missing_text,
    )
    styled = re.sub(r"\x1b\[[0-9;]*m", "", text_table(*spec, styled=True))  # without the bold
    assert "─" in styled  # rich's rule under the header
    plain = text_table(*spec, styled=False)
    words = lambda text: [line.split() for line in text.splitlines() if line.strip() and "─" not in line]
    assert words(styled) == words(plain)


def test_a_scale_report_keeps_the_spread_and_warns_on_it(tmp_path):
    from dpscale.lab.bench import script_scaling, script_scaling_report

    def point(n, p10, p90):
        return {
            "world_size": n, "engine": "torch", "transport": "gloo", "steps": 10, "step_ms": 10.0,
            "step_ms_p90": p90, "samples_per_step": 64.0 * n, "samples_per_s": 6400.0 * n,
            "efficiency": 1.0, "exposed_comm_ms": 1.0, "step_ms_p10": p10,
        }  # fmt: skip

    doc = {"config": {"script": "train.py", "args": [], "world_sizes": [1, 2]}, "profile": None}
    result = script_scaling.ScaleResult.from_dict(
        {**doc, "points": [point(1, 9.5, 10.5), point(2, 8.0, 14.0)]}
    )
    (warning,) = script_scaling_report.warnings(result)
    assert "(torch N=2 60%)" in warning
    old = {k: v for k, v in point(1, None, 11.0).items() if k != "step_ms_p10"}  # an older report's point
    assert script_scaling.ScaleResult.from_dict({**doc, "points": [old]}).points[0].spread is None
    d = tmp_path / "scale"
    d.mkdir()
    r = report.ReportDir(path=d, command="scale", argv=["dpscale", "scale"], system=STUDY_V0["system"])
    script_scaling_report.write_report(result, r)
    assert "- **Warning:** times spread (p10-p90)" in (d / "report.md").read_text()
    assert "p10 ms" in script_scaling_report.format_table(result)
