"""Files dpscale writes are opened without following a symbolic link (issue #34): a link planted
as metrics.jsonl (or a report, a profile) would have the target truncated and overwritten."""

import json
import os
from pathlib import Path

import pytest

from dpscale.cli.main import main
from dpscale.paths import open_no_follow, write_no_follow


def test_a_symlinked_metrics_file_is_refused_and_its_target_untouched(tmp_path, capsys):
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    (metrics / "metrics.jsonl").symlink_to(target)
    code = main(["train", "--workload", "synthetic", "--max-steps", "2", "--metrics-dir", str(metrics)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "metrics.jsonl is a symbolic link" in err[0]
    assert target.read_text() == "keep me\n"


def test_the_metrics_writer_itself_refuses_a_link_planted_after_the_check(tmp_path):
    from dpscale.train.metrics import MetricsWriter

    target = tmp_path / "precious"
    target.write_text("keep me\n")
    (tmp_path / "metrics.jsonl").symlink_to(target)
    for resumed_from in (None, 3):
        with pytest.raises(ValueError, match="is a symbolic link"):
            MetricsWriter(str(tmp_path), resumed_from=resumed_from)
    assert target.read_text() == "keep me\n"


@pytest.mark.parametrize("mode", ["w", "a", "wb"])
def test_open_no_follow_refuses_links_and_fifos_and_writes_files(tmp_path, mode):
    target = tmp_path / "target"
    target.write_text("x")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(ValueError, match="symbolic link or not a regular file"):
        open_no_follow(link, mode)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        open_no_follow(fifo, mode)
    assert target.read_text() == "x"
    write_no_follow(tmp_path / "new", b"ab" if "b" in mode else "ab")
    assert (tmp_path / "new").read_text() == "ab"


@pytest.mark.parametrize("name", ["report.md", "report.json", "table.csv", "fig.png"])
def test_a_report_file_planted_as_a_link_is_refused(tmp_path, monkeypatch, name):
    import dpscale.lab.bench.report as report_module
    from dpscale.lab.bench.report import ReportDir, new_figure

    data = Path(__file__).parent / "lab" / "bench" / "data" / "study-quick-v0.json"
    system = json.loads(data.read_text())["system"]
    monkeypatch.setattr(report_module, "collect_system_info", lambda: system)  # no uname: fast tier

    target = tmp_path / "precious"
    target.write_text("keep me\n")
    report = ReportDir.create(tmp_path / "reports", "allreduce", argv=["dpscale", "bench"])
    (report.path / name).symlink_to(target)
    with pytest.raises(ValueError, match="symbolic link"):
        if name == "report.md":
            report.write_markdown("t", [])
        elif name == "report.json":
            report.write_json({"x": 1})
        elif name == "table.csv":
            report.write_csv("table", [{"a": 1}])
        else:
            report.save_figure(new_figure(), "fig")
    assert target.read_text() == "keep me\n"
