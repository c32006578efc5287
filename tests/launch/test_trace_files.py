"""`--trace` on `dpscale run` and `scale`: two ranks' Chrome traces loaded back and checked against
their own records; a bad window is one line and exit 2 before anything runs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dpscale.cli.main import main
from dpscale.engine.trace import BUCKET_TID0, PHASE_TID, STEP_TID

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "wrap_if_distributed.py")
DPSCALE = [sys.executable, "-m", "dpscale.cli.main"]


def _load(folder: Path, world: int) -> list[dict]:
    return [json.loads((folder / f"rank{r}.trace.json").read_text()) for r in range(world)]


def _check(trace: dict, rank: int, steps: list[int]) -> None:
    assert trace["distributedInfo"]["rank"] == rank and trace["dpscale"]["steps"] == steps
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {rank} and all(e["args"]["rank"] == rank for e in events)
    per_step = []
    for step in (e for e in events if e["tid"] == STEP_TID):
        k = step["args"]["step"]
        phases = sum(e["dur"] for e in events if e["tid"] == PHASE_TID and e["args"]["step"] == k)
        assert phases == pytest.approx(step["dur"], rel=0.05)
        per_step.append(sum(1 for e in events if e["tid"] >= BUCKET_TID0 and e["args"]["step"] == k))
    assert per_step and min(per_step) >= 1 and len(set(per_step)) == 1  # every step reduces every bucket


@pytest.mark.slow
def test_run_writes_a_trace_per_rank_bounded_by_the_window(tmp_path):
    p = subprocess.run(
        [*DPSCALE, "run", "--nproc", "2", "--trace", "t", "--trace-steps", "3:6", SCRIPT, "--steps", "12"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    for rank, trace in enumerate(_load(tmp_path / "t", 2)):
        _check(trace, rank, [3, 4, 5])


@pytest.mark.slow
def test_scale_writes_a_folder_of_traces_per_world_size(tmp_path):
    cmd = ["scale", "--nproc", "2", "--steps", "4", "--warmup", "1", "--trace", "t", "--trace-steps", "2:4"]
    p = subprocess.run(
        [*DPSCALE, *cmd, "--report-dir", "r", "--", SCRIPT, "--steps", "20"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    for rank, trace in enumerate(_load(tmp_path / "t" / "n2", 2)):
        _check(trace, rank, [2, 3])


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--trace", "t", "--trace-steps", "5", SCRIPT],
        ["run", "--trace-steps", "3:6", SCRIPT],
        ["scale", "--trace", "t", "--trace-steps", "6:2", "--", SCRIPT],
        ["scale", "--trace", "t", "--trace-steps", "40:50", "--steps", "5", "--", SCRIPT],
        ["train", "--workload", "synthetic", "--trace", "t", "--trace-steps", "0:3"],
    ],
)
def test_a_bad_window_is_one_line_and_exit_2_before_anything_runs(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "--trace-steps" in err and "\n" not in err
    assert not (tmp_path / "t").exists()
