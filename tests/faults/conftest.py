"""Fault scenarios: one uninterrupted reference run that every scenario must reproduce.

The helpers that run the CLI live in tests/support/cli_runs.py: a test imports them from there,
never from a conftest (two conftest modules share one name, so which one `import conftest` finds
depends on which test directories pytest was given).
"""

from __future__ import annotations

import pytest

from support.cli_runs import TRAIN, last_json, run_cli


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> dict:
    """The run every fault scenario must reproduce: TRAIN with no fault; its checkpoints are kept."""
    ckpt = tmp_path_factory.mktemp("reference") / "ckpt"
    p = run_cli(TRAIN + ["--checkpoint-dir", str(ckpt)])
    assert p.returncode == 0, p.stderr
    out = last_json(p.stdout)
    assert out["steps"] == 30 and out["resumed_from_step"] is None
    assert sorted(d.name for d in ckpt.iterdir()) == ["step-00000010", "step-00000020", "step-00000030"]
    return {**out, "checkpoint_dir": ckpt}
