"""`dpscale train --lr 0 --json`: a measurement run that keeps the weights and reports the noise scale."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def train(*extra):
    args = [sys.executable, "-m", "dpscale.cli.main", "train", "--nproc", "2", "--workload", "digits"]
    args += ["--global-batch", "128", "--lr", "0", "--progress", "none", "--json", *extra]
    p = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two multi-worker CLI runs
def test_lr_zero_measures_the_noise_scale_without_moving_the_weights(tmp_path):
    long = train("--max-steps", "30", "--noise-scale-every", "2", "--metrics-dir", str(tmp_path))
    short = train("--max-steps", "1", "--no-noise-scale")
    assert long["param_sha256"] == short["param_sha256"]  # lr 0: the weights stayed where they were
    assert long["gradient_noise_scale"] > 0
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "gns" in lines[0] and lines[-1]["gns"] is not None
    assert short["gradient_noise_scale"] is None  # --no-noise-scale: none measured
