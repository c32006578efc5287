"""The test tiers and their bounds (#18): what CI runs, and what keeps the suite inside its budget.
Each is checked by what it does: the configuration this very pytest runs under, `.ci/run` with a
stand-in `make`, `make test-fast` and `make test` on probe tests (tests/support/tier_probes.py), and
the measure that sorts the slow tests into `make test`'s two lanes (tests/support/cpu_times.py)."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.cpu_times import TreeCpu

ROOT = Path(__file__).resolve().parents[1]


def test_every_test_is_bounded_well_inside_cis_budget(pytestconfig):
    # what pytest-timeout applies to this run (the ini, or --timeout given on the command line):
    # one hung test must fail with its stacks, not eat the whole CI run
    assert pytestconfig.pluginmanager.hasplugin("timeout")
    timeout_s = pytestconfig.getoption("timeout") or pytestconfig.getini("timeout")
    assert 0 < float(timeout_s) <= 300
    # the tiers rest on the slow marker: it is declared, and a misspelt marker is an error
    assert any(line.startswith("slow:") for line in pytestconfig.getini("markers"))
    assert pytestconfig.getoption("strict_markers")


def _stand_in_make(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A `make` first on PATH that records its arguments and fails for the target in $FAIL_TARGET."""
    calls = tmp_path / "calls"
    make = tmp_path / "bin" / "make"
    make.parent.mkdir()
    make.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n[ "$1" != "$FAIL_TARGET" ]\n')
    make.chmod(0o755)
    return {**os.environ, "PATH": f"{make.parent}:{os.environ['PATH']}"}, calls


@pytest.mark.slow
def test_ci_runs_the_lint_then_the_whole_suite_and_a_lint_error_stops_it(tmp_path):
    env, calls = _stand_in_make(tmp_path)
    subprocess.run(["bash", str(ROOT / ".ci" / "run")], env=env, check=True, timeout=60)
    made = calls.read_text().splitlines()
    assert made[0] == "lint" and "test" in made, made  # the lint first, then the whole suite (and more)
    calls.unlink()
    failed = subprocess.run(
        ["bash", str(ROOT / ".ci" / "run")], env={**env, "FAIL_TARGET": "lint"}, timeout=60
    )
    assert failed.returncode != 0 and calls.read_text().splitlines() == ["lint"]


@pytest.mark.slow
def test_make_test_fast_leaves_out_slow_tests_and_fails_one_that_starts_a_process(tmp_path):
    stamp = tmp_path / "installed"
    stamp.touch()  # newer than pyproject.toml and the Makefile: make installs nothing
    probes = "tests/support/tier_probes.py"
    p = subprocess.run(
        ["make", "-s", "test-fast", f"PY={sys.executable}", f"STAMP={stamp}", f"PYTEST_ARGS={probes}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert f"FAILED {probes}::test_probe_a_fast_test_that_starts_a_process" in out, out
    assert "mark it @pytest.mark.slow" in out, out  # conftest.py's refusal, saying what to do
    # the slow probe was left out: run, it fails too (under xdist the summary counts no deselected)
    assert re.search(r"\b1 failed\b", out) and "passed" not in out, out
    assert "test_probe_a_slow_test" not in out, out


def _make_test(tmp_path: Path, select: str) -> subprocess.CompletedProcess:
    """`make test` on the probes that `select` (-k) picks, the lanes meeting in a fresh folder."""
    stamp, marks = tmp_path / "installed", tmp_path / select.replace(" ", "_")
    stamp.touch()
    marks.mkdir()
    args = f"tests/support/tier_probes.py -k '{select}'"
    make = ["make", "-s", "test", f"PY={sys.executable}", f"STAMP={stamp}", "PYTEST_WORKERS=0"]
    return subprocess.run(
        [*make, f"PYTEST_ARGS={args}"],
        cwd=ROOT,
        env={**os.environ, "TIER_PROBE_DIR": str(marks)},
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.slow
def test_make_test_runs_the_waiting_lane_beside_the_others_and_fails_when_it_fails(tmp_path):
    # both lane probes wait for each other's mark: they pass only when the lanes run side by side
    p = _make_test(tmp_path, "lane and not fails")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert len(re.findall(r"\b1 passed\b", out)) == 2, out  # one probe in each lane
    # the same with a failure in the waiting lane alone: the target fails, showing that lane's output
    p = _make_test(tmp_path, "lane")
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "FAILED tests/support/tier_probes.py::test_probe_lane_waiting_fails" in out, out
    assert "the waiting lane's failure" in out and re.search(r"\b1 failed, 1 passed\b", out), out


def _running(pid: int) -> bool:
    """Whether `pid` exists and has not ended (init may not reap an orphan at once: a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


BUSY = "import time\nend = time.process_time() + 1\nwhile time.process_time() < end: pass"


@pytest.mark.slow
def test_cpu_times_count_a_process_whose_parent_ended_before_it(tmp_path):
    # what `--cpu-times` sorts the lanes by: a killed launcher leaves its workers to init, and their
    # CPU still counts (neither getrusage nor the parent's times would have it)
    tree = TreeCpu(os.getpid())
    before = tree.start()
    pid_file = tmp_path / "pid"
    sh = f"{sys.executable} -c '{BUSY}' & echo $! > {pid_file}; sleep 0.5"  # the shell ends first
    subprocess.run(["sh", "-c", sh], check=True, timeout=60)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 60
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    cpu_s = tree.stop(before)
    assert 0.8 <= cpu_s < 5, cpu_s  # the busy second, less what the last samples missed
