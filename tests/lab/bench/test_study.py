"""`dpscale study --quick`: the main job end to end, as a user runs it."""

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts processes (spawned ranks or the CLI)

ROOT = Path(__file__).resolve().parents[3]
SUMMARY_KEYS = {
    "model",
    "engine",
    "transport",
    "world_size",
    "samples_per_s",
    "efficiency",
    "spread",
    "exposed_comm_ms",
    "overhead_ms",
    "busbw_GBps",
    "convergence_gap",
    "time_to_target_s",
    "statistical_efficiency",
    "convergence_target",
    "convergence_status",
}


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_quick_study_writes_the_combined_report(tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpscale.cli.main",
            "study",
            "--quick",
            "--models",
            "mlp",
            "--report-dir",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout.strip().splitlines()[-1])
    assert {(r["engine"], r["world_size"]) for r in rows} == {
        (e, n) for e in ("dpscale", "torch", "local") for n in (1, 2)
    }
    for r in rows:
        assert set(r) == SUMMARY_KEYS
        # each figure is its own row's: the gap only where convergence trained (digits, dpscale)
        assert (r["convergence_gap"] is not None) == (r["model"] == "digits"), r
        assert (r["samples_per_s"] is not None) == (r["model"] == "mlp"), r
        # time to target only where it was trained (digits with dpscale; the mlp has no target)
        assert (r["convergence_status"] is not None) == (r["model"] == "digits"), r
        assert (r["time_to_target_s"] is not None) == (r["convergence_status"] == "reached"), r
    digits = {r["world_size"]: r for r in rows if r["model"] == "digits"}
    assert (
        digits[1]["statistical_efficiency"] == 1.0
        and digits[1]["convergence_target"] == "eval accuracy >= 0.8"
    )
    assert "indicative only" in p.stderr
    (report,) = tmp_path.iterdir()
    for sub in ("allreduce", "scaling-mlp", "convergence", "weak-digits-dpscale"):
        assert (report / sub / "report.md").is_file() and (report / sub / "report.json").is_file()
    doc = json.loads((report / "report.json").read_text())
    assert doc["command"] == "study" and doc["results"]["summary"] == rows
    assert {p["transport"] for p in doc["results"]["allreduce"]["points"]} == {"shm", "gloo"}
    md = (report / "report.md").read_text()
    assert "## Warnings" in md and "indicative only" in md
    for engine in ("dpscale", "torch", "local"):
        assert f"| mlp | {engine} |" in md
    assert "| not trained |" in md
    pngs = list(report.rglob("*.png"))
    assert len(pngs) >= 4
    for png in pngs:
        w, h = png_size(png)
        assert 400 <= w <= 3000 and 300 <= h <= 3000, (png, w, h)
    for line in md.splitlines():
        if line.startswith("!["):
            assert (report / line.split("](")[1].rstrip(")")).is_file()
