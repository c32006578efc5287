"""A report.json is read back from disk, where anyone may have edited it (issue #34): its strings
go into report.md with nothing that acts there (HTML, markdown links, code spans, table cells) or
on a terminal (ANSI escapes); NaN, huge numbers, deep nesting, bad UTF-8 or a value of the wrong
type are one line naming the key, never a traceback."""

import copy
import json
from pathlib import Path

import pytest

from dpscale.cli.main import main
from dpscale.lab.bench.report import safe_text

STUDY_V0 = json.loads((Path(__file__).parent / "data" / "study-quick-v0.json").read_text())
HOSTILE = "<script>alert(1)</script> [click](http://evil) `code` a|b \x1b[31mred\x1b[0m"


def _write(directory: Path, doc: dict | str | bytes) -> Path:
    directory.mkdir(parents=True)
    data = doc if isinstance(doc, str | bytes) else json.dumps(doc)
    if isinstance(data, bytes):
        (directory / "report.json").write_bytes(data)
    else:
        (directory / "report.json").write_text(data)
    return directory


def test_strings_from_report_json_are_escaped_in_report_md(tmp_path, capsys):
    doc = copy.deepcopy(STUDY_V0)
    doc["system"]["hostname"] = HOSTILE
    doc["argv"] = ["dpscale", "study", HOSTILE]
    directory = _write(tmp_path / "r", doc)
    assert main(["report", str(directory)]) == 0, capsys.readouterr().err
    md = (directory / "report.md").read_text()
    assert "&lt;script&gt;" in md
    for raw in ("<script>", "[click](", "\x1b", "a|b"):
        assert raw not in md, raw


def test_safe_text_keeps_ordinary_text():
    assert safe_text("dpscale bench allreduce --sizes 4K,16M --nproc 2") == (
        "dpscale bench allreduce --sizes 4K,16M --nproc 2"
    )
    assert "\x1b" not in safe_text(HOSTILE) and "<" not in safe_text(HOSTILE)


def _bad(doc_change):
    doc = copy.deepcopy(STUDY_V0)
    doc_change(doc)
    return doc


@pytest.mark.parametrize(
    "content, words",
    [
        (
            json.dumps(STUDY_V0).replace('"wall_s": ', '"wall_s": NaN, "x": ', 1),
            "wall_s is nan, not a finite number",
        ),
        (_bad(lambda d: d["results"].update(wall_s=1e300)), "results.wall_s is 1e+300"),
        (_bad(lambda d: d["results"].update(wall_s=10**400)), "results.wall_s is an integer of 401 digits"),
        (json.dumps({**STUDY_V0, "extra": json.loads("[" * 40 + "]" * 40)}), "extra[0][0]"),
        ("[" * 100000 + "]" * 100000, "nested too deeply"),
        (b'{"command": "study", "results": {}, "system": {"hostname": "\xff\xfe"}}', "not UTF-8 text"),
        (_bad(lambda d: d["results"].update(wall_s="long")), "report.json"),
        (_bad(lambda d: d["results"].update(scaling=5)), "report.json"),
        (_bad(lambda d: d.update(system=[1])), "lacks the system"),
        (_bad(lambda d: d.update(command=5)), "command is int"),
    ],
)
def test_a_bad_report_json_is_one_line_naming_what(tmp_path, capsys, content, words):
    directory = _write(tmp_path / "r", content)
    code = main(["report", str(directory)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert words in err[0], err[0]


def test_comparing_reports_with_a_bad_value_is_one_line(tmp_path, capsys):
    good = _write(tmp_path / "a", STUDY_V0)
    bad = _write(tmp_path / "b", json.dumps(STUDY_V0).replace('"wall_s": ', '"wall_s": Infinity, "y": ', 1))
    code = main(["report", str(good), str(bad), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "wall_s is inf, not a finite number" in err[0], err
