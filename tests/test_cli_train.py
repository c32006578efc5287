"""`dpscale train` end to end: the launcher and torchrun compatibility.

Bad input (one line, exit 2, nothing written) is checked in tests/faults/test_bad_cli_input.py;
`python -m dpscale.launch.worker` under plain torchrun in tests/test_cli_task.py (with a --task)
and, with the digits workload, in tests/multihost (the one-host reference runs).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.torchrun import torchrun

pytestmark = pytest.mark.slow  # starts processes (spawned ranks or the CLI)

ROOT = Path(__file__).resolve().parents[1]
DPSCALE = [sys.executable, "-m", "dpscale.cli.main"]


def run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=kw.pop("cwd", ROOT), **kw)


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_digits_with_two_workers_reaches_95_percent(tmp_path):
    p = run(
        DPSCALE
        + [
            "train",
            "--nproc",
            "2",
            "--workload",
            "digits",
            "--json",
            "--checkpoint-dir",
            str(tmp_path / "ck"),
            "--metrics-dir",
            str(tmp_path / "m"),
        ]
    )
    assert p.returncode == 0, p.stderr
    out = last_json(p.stdout)
    for key in (
        "world_size",
        "global_batch",
        "micro_batch",
        "accumulation_steps",
        "steps",
        "samples_seen",
        "final_loss",
        "test_accuracy",
        "samples_per_s",
        "param_sha256",
        "checkpoint",
    ):
        assert key in out, key
    assert out["world_size"] == 2 and out["accumulation_steps"] == 1
    assert out["test_accuracy"] >= 0.95
    assert Path(out["checkpoint"]).is_dir()
    assert (tmp_path / "m" / "metrics.jsonl").stat().st_size > 0
    assert "test accuracy" in p.stderr  # the summary table


def test_ddp_style_example_under_torchrun(tmp_path):
    p = run(torchrun(tmp_path, "--standalone", "--nproc-per-node", "2", "examples/train_ddp_style.py"))
    assert p.returncode == 0, p.stderr
    acc = float(p.stdout.strip().splitlines()[-1].split()[-1].rstrip("%"))
    assert acc >= 95.0
