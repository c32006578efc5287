"""Fault scenarios: helpers to run `dpscale train` as a user would, and one uninterrupted reference run.

Each CLI run gets its own session, so after it exits the helper can check that nothing it started
(agent, forkserver, workers) is still running, and kill that session if it is.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# 2 workers, 30 steps, a checkpoint every 10: kills at 15 lose 5 steps, resumes start at 10 or 20.
# `synthetic` needs no scikit-learn import, which would cost each worker seconds.
TRAIN = [
    "train",
    "--nproc",
    "2",
    "--workload",
    "synthetic",
    "--max-steps",
    "30",
    "--checkpoint-every",
    "10",
    "--json",
    "--progress",
    "plain",
]


def _session_members(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # field 6 of /proc/PID/stat is the session id; the name (field 2) may hold spaces
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


def run_cli(
    args: list[str], *, faults: str | None = None, timeout_s: float = 150
) -> subprocess.CompletedProcess:
    """`python -m dpscale.cli ARGS` with DPSCALE_FAULTS=`faults`; fails if it leaves a process behind."""
    env = {k: v for k, v in os.environ.items() if k != "DPSCALE_FAULTS"}
    if faults:
        env["DPSCALE_FAULTS"] = faults
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpscale.cli", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"dpscale {' '.join(args)} still ran after {timeout_s} s\n{err[-5000:]}")
    deadline = time.monotonic() + 5
    while (left := _session_members(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)  # the forkserver exits shortly after its parent
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"dpscale {' '.join(args)} left processes running: {left}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


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
