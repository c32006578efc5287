"""`dpscale train --task` on CUDA: each worker on its LOCAL_RANK's GPU over NCCL, mixed precision,
fp16 loss scaling. Skipped without a GPU; scripts/gpu-check.sh runs these on a machine with one."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TASKS = Path(__file__).resolve().parent
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _train(*flags, nproc=1):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpscale.cli.main",
            "train",
            "--task",
            "user_tasks:tensor_task",
            "--nproc",
            str(nproc),
            "--global-batch",
            "32",
            "--epochs",
            "5",
            "--progress",
            "none",
            "--json",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=TASKS,
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_task_trains_on_one_gpu(precision):
    out = _train("--device", "cuda", "--precision", precision, "--data-workers", "1")
    assert out["transport"] == "nccl" and out["eval"]["accuracy"] > 0.9 and out["skipped_steps"] <= 2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_task_trains_on_two_gpus_like_on_one():
    one, two = _train("--device", "cuda"), _train("--device", "cuda", nproc=2)
    assert two["world_size"] == 2 and two["eval"]["accuracy"] > 0.9
    assert abs(one["final_loss"] - two["final_loss"]) < 1e-3


def test_auto_picks_the_gpu():
    assert _train()["transport"] == "nccl"
