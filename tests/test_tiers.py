"""The test tiers and their bounds (#18): what CI runs, and what keeps the suite inside its budget."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_test_is_bounded_well_inside_cis_budget():
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    # one hung test must fail with its stacks, not eat the whole 15-minute CI run
    assert 0 < ini["timeout"] <= 300
    assert "slow" in " ".join(ini["markers"]) and "--strict-markers" in ini["addopts"]


def test_ci_runs_the_whole_suite_and_the_lint():
    steps = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "make test" in steps and "make lint" in steps


def test_the_fast_tier_leaves_out_what_starts_processes_and_refuses_the_rest():
    make = (ROOT / "Makefile").read_text()
    (recipe,) = [line for line in make.splitlines() if '-m "not slow"' in line]
    assert "DPSCALE_TEST_NO_SPAWN=1" in recipe  # conftest.py fails a fast test that starts a process
