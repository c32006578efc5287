"""The one list of benches (lab/bench/benches.py): a bench in it is a command, re-renders and compares."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dpscale.cli import bench as bench_cli
from dpscale.cli.main import build_parser, main
from dpscale.lab.bench import benches
from dpscale.lab.bench import report as report_module
from dpscale.lab.bench.bench import Bench, Figures, points
from dpscale.lab.bench.report import ReportDir


def test_every_bench_is_a_command_and_its_reports_rerender_and_compare():
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    bench_names = set(commands["bench"]._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    for b in benches.BENCHES:
        assert b.argv[1] in bench_names if b.argv[0] == "bench" else b.argv[0] in commands
        assert b.command in benches.RENDERERS and b.command in benches.FIGURES


@dataclass(frozen=True, kw_only=True)
class EchoConfig:
    times: int = 2
    """How many points."""


@dataclass
class EchoResult:
    config: EchoConfig
    values: list[int]

    def to_dict(self) -> dict:
        return {"config": {"times": self.config.times}, "points": [{"n": v} for v in self.values]}


def _write(result: EchoResult, report: ReportDir) -> None:
    doc = result.to_dict()
    report.write_json(doc, config=doc["config"])
    report.write_markdown("Echo bench", [])


ECHO = Bench(
    command="echo",
    argv=("bench", "echo"),
    help="a bench made in a test",
    Config=EchoConfig,
    run=lambda config: EchoResult(config, list(range(config.times))),
    from_dict=lambda doc: EchoResult(EchoConfig(**doc["config"]), [p["n"] for p in doc["points"]]),
    write_report=_write,
    compare=Figures(("n",), (), ("n",), points),
    text=lambda result: [f"echo {result.values}"],
    json_line=lambda result: json.dumps(result.values),
)


def test_a_new_bench_is_one_entry_in_the_list(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_cli, "BENCHES", (*benches.BENCHES, ECHO))
    monkeypatch.setattr(bench_cli, "require_plots", lambda command: None)
    system = json.loads((Path(__file__).parent / "data" / "study-quick-v0.json").read_text())["system"]
    monkeypatch.setattr(report_module, "collect_system_info", lambda: system)  # no uname: fast tier
    assert main(["bench", "echo", "--times", "3", "--json", "--report-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "echo [0, 1, 2]" and out[-1] == "[0, 1, 2]"
    (report,) = tmp_path.iterdir()
    assert json.loads((report / "report.json").read_text())["results"]["points"][-1] == {"n": 2}
